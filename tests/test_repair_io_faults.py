"""The repairs of `concordia log check --fix` under I/O faults at the log's OS boundary (``FaultyOS``).

For every N, the Nth OS call a repair makes fails (EIO; a failed fsync also drops what was written since the
file's last good sync, as the kernel does when it gives up on dirty pages). Whatever point it stops at:
nothing committed is lost, bytes already cut are held durably in ``set-aside/``, the manifest is the old one or
the new one, and running the repair again with the real OS finishes it with the bytes a fault-free run gives.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import concordia_ft as cft
from concordia_ft.core.manifest import MANIFEST_NAME
from concordia_ft.core.oscalls import REAL_OS
from concordia_ft.core.repair import SET_ASIDE, apply_rebuild, cut_segment, plan_rebuild
from concordia_ft.core.replay import replay
from concordia_ft.errors import LogError
from faults import FaultyOS

PAGE = 4096


def _build(d: Path, seed: int) -> tuple[str, list[int], list[bytes]]:
    """Five epochs (numbered 1-5) of random pages (file backend, fsync always): the segment, the offset where
    each epoch ends, and the region's bytes at each epoch."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, 16 * PAGE, dtype=np.uint8)
    ends, images = [], []
    with cft.Runtime(d, fsync="always", compact_after_bytes=None) as rt:
        rt.register("a", a)
        for i in range(5):
            a[rng.integers(0, a.size, 3 * PAGE)] = rng.integers(0, 256, 3 * PAGE, dtype=np.uint8)
            assert rt.checkpoint(meta={"i": i}) == i + 1
            seg = max(d.glob("*.cft"), key=lambda p: p.stat().st_mtime_ns)
            ends.append(seg.stat().st_size)
            images.append(a.tobytes())
    return seg.name, ends, images


def _aside_files(d: Path) -> list[Path]:
    return sorted(p for p in (d / SET_ASIDE).rglob("*") if p.is_file()) if (d / SET_ASIDE).exists() else []


def _must_fail(repair: Callable[[], object], io: FaultyOS, n: int) -> None:
    """The repair raises the injected error, except a failed close after a good fsync (nothing to learn)."""
    try:
        repair()
    except OSError:
        return
    assert [op for _, op in io.failed] == ["close"], (n, io.failed)


def _count_calls(fn: object, *args: object, **kw: object) -> int:
    io = FaultyOS()
    io.arm(None)
    fn(*args, io=io, **kw)  # type: ignore[operator]
    return len(io.calls)


@pytest.mark.parametrize("drop", [False, True], ids=["eio", "eio+dropped-pages"])
def test_a_cut_that_fails_at_any_call_loses_nothing_and_finishes_when_rerun(tmp_path: Path, drop: bool) -> None:
    src = tmp_path / "src"
    seg, ends, images = _build(src, seed=7)
    cut_at = ends[2]  # damage epoch 4: a repair cuts it and everything after, keeping the bytes aside
    with open(src / seg, "r+b") as f:
        f.seek(cut_at + 200)
        b = f.read(1)
        f.seek(cut_at + 200)
        f.write(bytes([b[0] ^ 0x40]))
    tail = (src / seg).read_bytes()[cut_at:]
    probe = tmp_path / "probe"
    shutil.copytree(src, probe)
    n_calls = _count_calls(cut_segment, probe, seg, cut_at, keep_cut_bytes=True)
    assert n_calls >= 8  # open/write/fsync/close of the kept file, three directory syncs, open/ftruncate/fsync
    for n in range(1, n_calls + 1):
        d = tmp_path / f"n{n}"
        shutil.copytree(src, d)
        io = FaultyOS()
        io.arm(n, err=errno.EIO, drop_unsynced=drop)
        _must_fail(partial(cut_segment, d, seg, cut_at, keep_cut_bytes=True, io=io), io, n)
        size = (d / seg).stat().st_size
        assert size in (len(tail) + cut_at, cut_at), (n, size)
        if size == cut_at:  # cut: the bytes are already held aside, whole
            assert any(p.read_bytes() == tail for p in _aside_files(d)), n
            assert replay(d).epoch == 3
        cut_segment(d, seg, cut_at, keep_cut_bytes=True, io=REAL_OS)  # the operator runs it again
        r = replay(d)
        assert r.epoch == 3 and r.regions["a"].data.tobytes() == images[2], n
        assert (d / seg).stat().st_size == cut_at
        assert any(p.read_bytes() == tail for p in _aside_files(d)), n


def test_a_manifest_rebuild_that_fails_at_any_call_leaves_the_old_or_the_new_manifest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _seg, _ends, images = _build(src, seed=11)
    garbage = b"\x00not a manifest\xff" * 7
    (src / MANIFEST_NAME).write_bytes(garbage)
    with pytest.raises(LogError):
        replay(src)
    probe = tmp_path / "probe"
    shutil.copytree(src, probe)
    n_calls = _count_calls(apply_rebuild, probe, plan_rebuild(probe))
    assert n_calls >= 8
    for n in range(1, n_calls + 1):
        d = tmp_path / f"n{n}"
        shutil.copytree(src, d)
        io = FaultyOS()
        io.arm(n, err=errno.EIO, drop_unsynced=True)
        _must_fail(partial(apply_rebuild, d, plan_rebuild(d), io=io), io, n)
        if (d / MANIFEST_NAME).read_bytes() != garbage:  # the new one is in: the damaged one is held aside
            assert any(p.read_bytes() == garbage for p in _aside_files(d)), n
            assert replay(d).epoch == 5
        apply_rebuild(d, plan_rebuild(d))
        r = replay(d)
        assert r.epoch == 5 and r.regions["a"].data.tobytes() == images[4], n
        assert any(p.read_bytes() == garbage for p in _aside_files(d)), n
