"""Compaction: the threshold counts what is on disk, the base is sparse, memory stays bounded, failures surface.

Real logs on tmpfs, real processes' worth of restarts (a Runtime closed and reopened), faults injected at the
log's OS boundary under the compactor (``FaultyOS``: the base writer's pwritev), memory measured with tracemalloc (numpy's allocations are
traced) on logs larger than the bound.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import concordia_ft as cft
from concordia_ft.cli.main import main
from concordia_ft.core.compaction import FAILURE_NAME, compact_offline
from concordia_ft.core.manifest import load_manifest
from concordia_ft.core.replay import replay
from concordia_ft.errors import CompactionError
from faults import FullDiskForBases

PAGE = 4096


def test_the_threshold_counts_the_suffix_on_disk_across_restarts(shm_dir: Path) -> None:
    """8 restarts of a writer appending less than the threshold each once left 1.35 GB with no base."""
    d = shm_dir / "log"
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 64 * PAGE, dtype=np.uint8)  # 256 KiB
    threshold = 600_000
    for proc in range(5):
        with cft.Runtime(d, fsync="never", compact_after_bytes=threshold, background_compaction=False) as rt:
            rt.register("a", a)
            if rt.epoch is not None:
                rt.recover_into()
            appended = 0
            for _ in range(3):
                pages = rng.choice(64, size=24, replace=False)
                for p in pages:
                    a[p * PAGE : p * PAGE + 8] ^= 0xFF
                rt.checkpoint({"proc": proc})
                appended += rt.last_stats.total_bytes
            assert appended < threshold  # no single process crosses the threshold on its own
    m = load_manifest(d)
    assert m is not None and m.base is not None, "compaction never ran: the threshold was counted per process"
    res = replay(d)
    assert res.epoch == 15 and (res.regions["a"].data == a).all()
    suffix = sum((d / n).stat().st_size for n in m.incr)
    assert suffix < threshold + 400_000, suffix


def _sparse_log(d: Path) -> tuple[dict[str, np.ndarray], cft.Runtime]:
    rng = np.random.default_rng(2)
    block = 4 * PAGE
    kv = np.zeros(2048 * block, dtype=np.uint8)  # 32 MiB arena, initially zero
    flags = np.zeros(2048, dtype=np.uint8)
    opq = np.zeros(2048 * PAGE, dtype=np.uint8)  # 8 MiB opaque
    rt = cft.Runtime(d, fsync="never", compact_after_bytes=None)
    rt.register("kv", kv, "paged", block_bytes=block, dirty_blocks=flags, initially_zero=True)
    rt.register("opq", opq)
    rt.checkpoint()
    for step in range(6):
        for b in rng.choice(2048, size=5, replace=False):
            kv[b * block : b * block + 3000] = rng.integers(1, 256, 3000, dtype=np.uint8)
            flags[b] = 1
        opq[step * 40 * PAGE : step * 40 * PAGE + 100] = 7  # written...
        if step >= 2:
            opq[(step - 2) * 40 * PAGE : (step - 2) * 40 * PAGE + 100] = 0  # ...and zeroed again
        rt.checkpoint({"step": step})
    return {"kv": kv, "opq": opq}, rt


@pytest.mark.parametrize("how", ["offline", "writer"])
def test_the_base_is_sparse_and_replays_identical_bytes(how: str, shm_dir: Path) -> None:
    """A 4.8 MiB sparse demo log once became a 45 MiB base (the zero pages of its regions were stored)."""
    d = shm_dir / "log"
    arrays, rt = _sparse_log(d)
    suffix = sum((d / n).stat().st_size for n in rt.log.manifest.incr)
    if how == "writer":
        r = rt.compact()
        rt.close()
    else:
        rt.close()
        r = compact_offline(d)
    assert r is not None and r.compacted and r.base is not None
    base = (d / r.base).stat().st_size
    live = 30 * 4 * PAGE + 2 * PAGE  # 30 blocks of the arena and 2 pages of the opaque region hold data
    assert base < live + 64 * 1024, (base, suffix)  # not the 40 MiB of the regions
    res = replay(d)
    for name, a in arrays.items():
        assert res.regions[name].data.tobytes() == a.tobytes(), name
    with cft.Runtime(d) as rt2:  # and a writer continues from it
        b = {n: np.zeros_like(a) for n, a in arrays.items()}
        rt2.recover_into(b)
        assert all((b[n] == arrays[n]).all() for n in arrays)


def _big_log(d: Path, nbytes: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    with cft.Runtime(d, fsync="never", compact_after_bytes=None) as rt:
        rt.register("big", a, "dense")
        rt.checkpoint()
        for i in range(3):
            a[i * 1_000_000 : i * 1_000_000 + 5] = i
            rt.checkpoint()
    return a


def _peak(fn: Any) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


def test_compaction_check_and_inspect_stream_in_bounded_memory(shm_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Compaction built the whole state in RAM; check and inspect built every region image."""
    d = shm_dir / "log"
    size = 64 << 20
    a = _big_log(d, size)
    bound = 16 << 20  # well under the 64 MiB state (and the ~256 MiB log); measured ~3 MiB
    rc, peak = _peak(lambda: main(["log", "check", str(d)]))
    assert rc == 0 and peak < bound, peak
    rc, peak = _peak(lambda: main(["log", "inspect", str(d), "--json"]))
    assert rc == 0 and peak < bound, peak
    capsys.readouterr()
    r, peak = _peak(lambda: compact_offline(d))
    assert r.compacted and peak < bound, peak
    res = replay(d)
    assert res.epoch == 4 and res.regions["big"].data.tobytes() == a.tobytes()


def test_a_background_compaction_failure_is_raised_by_the_next_checkpoint(shm_dir: Path,
                                                                          capsys: pytest.CaptureFixture[str]
                                                                          ) -> None:
    """ENOSPC injected at the log's OS boundary under the compactor: the base writer's pwritev fails."""
    d = shm_dir / "log"
    a = np.random.default_rng(4).integers(0, 256, 32 * PAGE, dtype=np.uint8)
    faulty = FullDiskForBases()
    with cft.Runtime(d, fsync="never", compact_after_bytes=None, log_io=faulty) as rt:
        rt.register("a", a)
        for i in range(3):
            a[i] = i + 1
            rt.checkpoint()
        faulty.full = True
        assert rt.compact(wait=False) is None
        deadline = time.monotonic() + 30
        while rt.compaction_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        faulty.full = False
        assert faulty.refused and not list(d.glob("*.tmp")), "the failed base's temp file is removed"
        a[5] = 9
        with pytest.raises(CompactionError, match="No space left") as ei:
            rt.checkpoint()
        assert "intact" in str(ei.value) and rt.epoch == 3  # raised before anything was written
        assert rt.checkpoint() == 4  # reported once; the log goes on
        recorded = json.loads((d / FAILURE_NAME).read_text())
        assert recorded["error"] == "OSError" and "No space left" in recorded["message"], recorded
        faulty.full = True
        with pytest.raises(CompactionError, match="No space left"):
            rt.compact()  # a foreground compaction raises its own failure
        faulty.full = False
    res = replay(d)
    assert res.epoch == 4 and (res.regions["a"].data == a).all()
    assert main(["log", "inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "last compaction failed" in out and "No space left" in out, out
    r = compact_offline(d)
    assert r.compacted and not (d / FAILURE_NAME).exists()
    assert main(["log", "inspect", str(d)]) == 0
    assert "last compaction failed" not in capsys.readouterr().out
    res = replay(d)
    assert res.epoch == 4 and (res.regions["a"].data == a).all()
