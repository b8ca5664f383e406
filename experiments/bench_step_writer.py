"""The C step-epoch writer alone: one epoch of N KV rows (Qwen3-0.6B dims: 112 KiB a row) + a 10 KB META record
into a mapped DRAM log, submitted and waited for (the durable step epoch's wait), per writer thread count.

    python experiments/bench_step_writer.py --rows 32 --threads 1,2,4
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from concordia_ft.core import slotlog  # noqa: E402
from concordia_ft.core.log import RecoveryLog  # noqa: E402
from concordia_ft.core.regions import RegionKind, RegionSpec  # noqa: E402


def run(rows: int, threads: int, steps: int) -> tuple[float, float, float]:
    d = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ppr = 28
    kv = RegionSpec("kv", RegionKind.PAGED, 4096 * ppr * 4 * rows, 4096, block_bytes=4096 * ppr)
    log = RecoveryLog.open(d / "log", {"backend": "dram", "fsync": "never"})
    log.append(defs=[kv])
    w = slotlog.StepLogWriter(log, threads=threads)
    buf = np.random.default_rng(0).integers(0, 255, 4096 * ppr * rows, dtype=np.uint8)
    sel = np.arange(0, 2 * rows, 2, dtype=np.int64)
    meta = b'{"a":' + b"1" * 10_000 + b"}"
    ts = []
    for i in range(steps):
        t0 = time.perf_counter()
        w.submit(i, slotlog.step_blob([slotlog.rows_record(b"kv", sel, ppr, 4096, buf.ctypes.data),
                                       slotlog.meta_record(meta)]))
        w.wait(i)
        ts.append(time.perf_counter() - t0)
    w.stop()
    st = w.stats()
    log.close()
    shutil.rmtree(d, ignore_errors=True)
    return 1e3 * float(np.median(ts)), 1e3 * float(np.percentile(ts, 99)), float(np.median(st[:, 3] - st[:, 2])) / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="32")
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    for rows in (int(x) for x in a.rows.split(",")):
        for t in (int(x) for x in a.threads.split(",")):
            p50, p99, app = run(rows, t, a.steps)
            print(f"rows={rows} ({rows * 112} KiB) threads={t}: submit+wait p50 {p50:.3f} ms p99 {p99:.3f} ms, "
                  f"writer append p50 {app:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
