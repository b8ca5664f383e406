"""The pinned mirror's follower (cuda/mirror.py ``LogMirror``) against a real DRAM log, on the CPU: the copies
live in memfd memory here (the provider the GPU host replaces with the driver's pinned host memory), everything
else is what a server runs: the keeper process, the epoch walk over the segment files, the marks, the drops after
a compaction. What the keeper holds below each mark is the segment file's bytes, byte for byte."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import concordia_ft as cft
from concordia_ft.core.keeper import KeeperClient, stop_keeper
from concordia_ft.core.manifest import load_manifest


class MemfdMemory:
    """Mirror memory from memfd_create: what the keeper gets is a real descriptor of the same bytes."""

    class Mem:
        def __init__(self, fd: int, nbytes: int) -> None:
            self.nbytes = nbytes
            self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

        def host_view(self) -> np.ndarray:
            return np.frombuffer(self.map, dtype=np.uint8)

        def close(self) -> None:
            try:
                self.map.close()
            except BufferError:
                pass

    def attach(self) -> None:
        return None

    def size(self, nbytes: int) -> int:
        return -(-nbytes // 4096) * 4096

    def create(self, nbytes: int) -> tuple[Mem, int]:
        fd = os.memfd_create("cft-mirror-test")
        os.ftruncate(fd, nbytes)
        mem = self.Mem(fd, nbytes)
        return mem, fd  # the follower hands fd to the keeper, then closes its own


@pytest.fixture()
def log(shm_dir: Path):  # type: ignore[no-untyped-def]
    d = shm_dir / "log"
    yield d
    stop_keeper(d)


def _kept(log: Path) -> dict[str, bytes]:
    """Segment name -> the bytes the keeper's memory holds below its mark."""
    out = {}
    for e in KeeperClient(log).list_entries():
        try:
            out[e.name] = os.pread(e.fd, e.mark, 0)
        finally:
            os.close(e.fd)
    return out


def _committed(path: Path) -> bytes:
    """The segment file's bytes up to the end of its last committed epoch (the replay's own walk)."""
    from concordia_ft.core.format import SEGMENT_HEADER_BYTES
    from concordia_ft.core.replay import walk_segment

    data = path.read_bytes()
    epochs, _ = walk_segment(memoryview(data), SEGMENT_HEADER_BYTES)
    end = epochs[-1].offset + epochs[-1].total_bytes if epochs else SEGMENT_HEADER_BYTES
    return data[:end]


def test_the_keeper_holds_every_committed_byte_and_forgets_compacted_segments(log: Path) -> None:
    from concordia_ft.cuda.mirror import LogMirror

    rng = np.random.default_rng(5)
    kv = rng.integers(0, 256, 512 * 4096, dtype=np.uint8)
    flags = np.ones(128, dtype=np.uint8)
    rt = cft.Runtime(log, fsync="never", backend="dram", compact_after_bytes=None, page_bytes=4096)
    try:
        rt.register("kv", kv, "paged", block_bytes=4 * 4096, dirty_blocks=flags)
        rt.checkpoint()
        mirror = LogMirror(log, memory=MemfdMemory(), poll_s=0.005)
        try:
            for _ in range(12):  # decode-like epochs while the follower runs
                rows = rng.integers(0, 128, 3)
                for r in rows:
                    kv[r * 16384:(r + 1) * 16384] = rng.integers(0, 256, 16384, dtype=np.uint8)
                    flags[r] = 1
                rt.checkpoint()
            assert mirror.wait_caught_up(30.0)
            man = load_manifest(log)
            assert man is not None
            kept = _kept(log)
            assert sorted(kept) == sorted(man.segments())
            for name in man.segments():
                assert kept[name] == _committed(log / name), name  # byte for byte, up to the last commit
            assert mirror.mirrored_bytes == sum(len(b) for b in kept.values()) > kv.nbytes
            before = set(kept)
            rt.compact()  # a base segment replaces the incremental ones
            rt.checkpoint()
            assert mirror.wait_caught_up(30.0)
            man = load_manifest(log)
            assert man is not None and man.base is not None
            kept = _kept(log)
            assert sorted(kept) == sorted(man.segments())  # the compacted-away segments were dropped
            assert not (before - set(man.segments())) & set(kept)
            for name in man.segments():
                assert kept[name] == _committed(log / name), name
        finally:
            mirror.close()
    finally:
        rt.close()
    assert KeeperClient(log).ping() is not None  # closing the follower leaves the keeper and its memory


def test_a_new_follower_drops_what_a_dead_one_left_for_segments_that_are_gone(log: Path) -> None:
    from concordia_ft.cuda.mirror import LogMirror

    kv = np.random.default_rng(6).integers(0, 256, 64 * 4096, dtype=np.uint8)
    with cft.Runtime(log, fsync="never", backend="dram", compact_after_bytes=None, page_bytes=4096) as rt:
        rt.register("kv", kv, "dense")
        rt.checkpoint()
    k = KeeperClient(log)
    mirror = LogMirror(log, memory=MemfdMemory(), poll_s=0.005)
    assert mirror.wait_caught_up(30.0)
    mirror.close()
    fd = os.memfd_create("stale")
    k.put("incr.999999.cft", b"x" * 32, 4096, fd, mark=100)  # as if for a segment this log no longer has
    os.close(fd)
    assert "incr.999999.cft" in _kept(log)
    again = LogMirror(log, memory=MemfdMemory(), poll_s=0.005)
    try:
        assert again.wait_caught_up(30.0)
        kept = _kept(log)
        assert "incr.999999.cft" not in kept
        man = load_manifest(log)
        assert man is not None and sorted(kept) == sorted(man.segments())
    finally:
        again.close()
