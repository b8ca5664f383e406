"""The DAX backend (a preallocated mapped segment): works where MAP_SYNC is refused and says it is not
durable; an unfinished append (whole in length, no commit marker) is a torn tail that a reopening writer
clears, and appends after it replay exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import concordia_ft as cft
from concordia_ft.core.epochs import plan_epoch
from concordia_ft.core.format import COMMIT_BYTES
from concordia_ft.core.replay import Outcome, replay
from concordia_ft.core.tracking import RegionDelta


def test_dax_backend_round_trip_and_torn_append(shm_dir: Path) -> None:
    rng = np.random.default_rng(9)
    a = rng.integers(0, 255, 50_000, dtype=np.uint8)
    rt = cft.Runtime(shm_dir / "log", backend="dax")
    assert rt.open_report.durable is False  # tmpfs refuses MAP_SYNC: said plainly, not claimed
    spec = rt.register("a", a)
    for i in range(3):
        a[rng.integers(0, a.size, 4)] ^= 0xFF
        rt.checkpoint(meta={"i": i})
    want = a.copy()
    # an append that never finished: the whole epoch but its commit marker, as a crash mid-copy leaves it
    seg = rt.log._segment
    pages = np.array([0, 3], dtype=np.int64)
    payload = memoryview(rng.integers(0, 255, 2 * spec.page_bytes, dtype=np.uint8))
    plan = plan_epoch(4, seg.end, defs=[], drops=[], deltas=[RegionDelta(spec, pages, payload)])
    raw = b"".join(bytes(p) for p in plan.parts)[:-COMMIT_BYTES]
    seg._view[seg.end : seg.end + len(raw)] = raw
    seg._map.flush()
    rt.log._segment.close()  # the process "dies": nothing else reaches the log
    rt.log._lock.release()
    res = replay(shm_dir / "log")
    assert res.outcome is Outcome.TORN_TAIL and res.epoch == 3 and "commit marker" in res.tail.reason
    assert res.regions["a"].data.tobytes() == want.tobytes()
    rt2 = cft.Runtime(shm_dir / "log", backend="dax")
    assert rt2.open_report.cut_bytes == len(raw)  # cleared, and said so
    b = np.zeros_like(a)
    rt2.register("a", b)
    rt2.recover_into()
    assert b.tobytes() == want.tobytes()
    b[7] ^= 1
    rt2.checkpoint(meta={"i": 4})
    rt2.close()
    rec = cft.recover(shm_dir / "log")
    assert rec.outcome is Outcome.OK and rec.epoch == 4 and rec.meta == {"i": 4}
    assert rec.regions["a"].tobytes() == b.tobytes()
