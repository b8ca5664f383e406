"""T5 + T6: end-to-end delta checkpoint of opaque CUDA regions, GPU handlers vs the CPU path, same run.

One epoch, end to end = detect dirty pages + stage them into pinned host memory + append + commit to a DRAM
log (``RecoveryLog`` on tmpfs, fsync=never: the DRAM log) + advance (hash/shadow update) finished on the GPU.

- GPU path: ``make_cuda_tracker`` (hash or shadow detector on the whole GPU, compacted page list, payload
  gathered straight into host-mapped pinned memory ("mapped") or into device memory + one DtoH ("device")).
  Device time = CUDA events around the collect kernels + around advance; wall = perf_counter from Python.
- CPU path (the paper's baseline): pinned DtoH of the whole region + numpy page compare against a host
  shadow + gather + the same append/commit + shadow update.

T5: 16/50/128/256/1024 MiB, 1 dirty page, hash and shadow. T6: 256 MiB, 1..32 dirty pages and 1%..100%.
Every epoch's page list is checked against the pages actually dirtied. Medians. Results:
benchmarks/results/delta_gpu-<tag>.json (benchreport.write_results).

    PYTHONPATH=src python benchmarks/bench_delta_gpu.py [--quick] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchreport import print_table, write_results

from concordia_ft.core.log import RecoveryLog
from concordia_ft.core.regions import DiffMode, RegionKind, RegionSpec
from concordia_ft.cuda import driver
from concordia_ft.cuda.trackers import make_cuda_tracker

PAGE = 4096
MiB = 1 << 20


class DramLog:
    """A fresh RecoveryLog per configuration on tmpfs (fsync never); a page-cache file log if no tmpfs."""

    def __init__(self) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.dir = Path(tempfile.mkdtemp(prefix="cft-bench-", dir=base))
        try:
            self.log = RecoveryLog.open(self.dir / "log", {"backend": "dram", "fsync": "never",
                                                             "segment_max_bytes": 8 << 30})
            self.backend = "dram"
        except Exception:  # noqa: BLE001 - no tmpfs: the page cache is still DRAM
            self.log = RecoveryLog.open(self.dir / "log", {"backend": "file", "fsync": "never",
                                                             "segment_max_bytes": 8 << 30})
            self.backend = "file(page cache)"

    def close(self) -> None:
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def dirty_pages(t: torch.Tensor, n_pages: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Flip one byte in each of k random pages (on the GPU); return the sorted page indices."""
    pages = np.sort(rng.choice(n_pages, size=k, replace=False)).astype(np.int64)
    offs = torch.from_numpy(pages * PAGE + rng.integers(0, PAGE, size=k)).cuda()
    t[offs] ^= torch.randint(1, 256, (k,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    return pages


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run_gpu(t: torch.Tensor, spec: RegionSpec, k: int, iters: int, staging: str, rng: np.random.Generator
            ) -> dict[str, Any]:
    """Two passes: wall time with profiling off, then GPU time with the profile gate (no host gaps)."""
    out = _gpu_pass(t, spec, k, iters, staging, rng, profile=False)
    prof = _gpu_pass(t, spec, k, iters, staging, rng, profile=True)
    out["device_ms"] = prof["device_ms"]
    out["device_collect_ms"] = prof["device_collect_ms"]
    out["device_advance_ms"] = prof["device_advance_ms"]
    return out


def _gpu_pass(t: torch.Tensor, spec: RegionSpec, k: int, iters: int, staging: str, rng: np.random.Generator,
              *, profile: bool) -> dict[str, Any]:
    stream = driver.Stream.from_torch()
    tr = make_cuda_tracker(spec, t, staging=staging, profile=profile, stream=stream)
    log = DramLog()
    try:
        d = tr.collect(full=True)
        log.log.append(defs=[spec], deltas=[d])
        tr.advance(d)
        stream.synchronize()
        wall, walls_commit, dev_c, dev_a = [], [], [], []
        for i in range(iters + 3):
            want = dirty_pages(t, spec.n_pages, k, rng)
            t0 = time.perf_counter()
            d = tr.collect(full=False)
            log.log.append(deltas=[d])
            t1 = time.perf_counter()
            tr.advance(d)
            stream.synchronize()
            t2 = time.perf_counter()
            if not np.array_equal(d.pages, want):
                raise AssertionError(f"{spec.name} {staging}: found {d.pages[:8]}... ({d.n_pages}), "
                                     f"dirtied {want[:8]}... ({len(want)})")
            if i >= 3:
                walls_commit.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
                if profile:
                    dev_c.append(tr.last_collect_device_ms)
                    dev_a.append(tr.last_advance_device_ms)
        res: dict[str, Any] = {"wall_ms": med(wall), "wall_to_commit_ms": med(walls_commit),
                               "device_state_bytes": getattr(tr, "device_state_bytes", 0), "log": log.backend}
        if profile:
            res.update(device_collect_ms=med(dev_c), device_advance_ms=med(dev_a),
                       device_ms=med([c + a for c, a in zip(dev_c, dev_a, strict=True)]))
        return res
    finally:
        log.close()
        tr.close()


def run_cpu(t: torch.Tensor, spec: RegionSpec, k: int, iters: int, rng: np.random.Generator) -> dict[str, Any]:
    """Pinned DtoH of the whole region + numpy page compare vs a host shadow + gather + append + commit."""
    n = spec.nbytes
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h = host.numpy()
    host.copy_(t)
    shadow = h.copy()
    log = DramLog()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        from concordia_ft.core.tracking import RegionDelta

        log.log.append(defs=[spec], deltas=[RegionDelta(spec, np.arange(spec.n_pages, dtype=np.int64),
                                                        memoryview(shadow))])
        wall, dtoh, cmp_ms = [], [], []
        for i in range(iters + 1):
            want = dirty_pages(t, spec.n_pages, k, rng)
            t0 = time.perf_counter()
            e0.record()
            host.copy_(t, non_blocking=True)
            e1.record()
            e1.synchronize()
            t1 = time.perf_counter()
            a = h.reshape(-1, PAGE).view(np.uint64)
            b = shadow.reshape(-1, PAGE).view(np.uint64)
            pages = np.flatnonzero((a != b).any(axis=1)).astype(np.int64)
            payload = h.reshape(-1, PAGE)[pages]
            t2 = time.perf_counter()
            log.log.append(deltas=[RegionDelta(spec, pages, memoryview(payload.reshape(-1)))])
            shadow.reshape(-1, PAGE)[pages] = payload
            t3 = time.perf_counter()
            if not np.array_equal(pages, want):
                raise AssertionError(f"CPU path found {len(pages)} pages, dirtied {len(want)}")
            if i >= 1:
                wall.append((t3 - t0) * 1e3)
                dtoh.append(e0.elapsed_time(e1))
                cmp_ms.append((t2 - t1) * 1e3)
        return {"wall_ms": med(wall), "dtoh_ms": med(dtoh), "compare_ms": med(cmp_ms), "log": log.backend}
    finally:
        log.close()
        del host


def guarded(fn: Any, *a: Any) -> dict[str, Any]:
    """Run one configuration; a failure becomes a row with the error (NaN times), the run goes on."""
    try:
        out: dict[str, Any] = fn(*a)
        return out
    except Exception as e:  # noqa: BLE001 - reported in the row and printed
        print(f"FAILED {fn.__name__}: {e!r}", flush=True)
        return {"wall_ms": float("nan"), "device_ms": float("nan"), "error": repr(e)[:300],
                "device_state_bytes": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and sizes (smoke run)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    iters = 10 if args.quick else args.iters
    cpu_iters = 3 if args.quick else 5
    sizes = [16, 256] if args.quick else [16, 50, 128, 256, 1024]
    rows: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] = []

    # ---- T5: region size, 1 dirty page ----
    for mb in sizes:
        n = mb * MiB
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        cpu = guarded(run_cpu, t, RegionSpec(f"r{mb}", RegionKind.OPAQUE, n), 1, cpu_iters, rng)
        baseline.append({"table": "T5", "region_mib": mb, "dirty_pages": 1, **cpu})
        for mode in (DiffMode.HASH, DiffMode.SHADOW):
            for staging in (("mapped", "device") if mb == 256 else ("mapped",)):
                spec = RegionSpec(f"r{mb}", RegionKind.OPAQUE, n, diff=mode)
                g = guarded(run_gpu, t, spec, 1, iters, staging, rng)
                rows.append({"table": "T5", "region_mib": mb, "dirty_pages": 1, "mode": mode.value,
                             "staging": staging, **g, "cpu_wall_ms": cpu["wall_ms"],
                             "speedup_wall": cpu["wall_ms"] / g["wall_ms"],
                             "state_pct_of_region": 100 * g["device_state_bytes"] / n})
        del t
        torch.cuda.empty_cache()

    # ---- T6: 256 MiB, dirty count and dirty fraction (crossover) ----
    n = 256 * MiB
    n_pages = n // PAGE
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    counts = [1, 2, 4, 8, 16, 32] + [max(1, n_pages * p // 100) for p in (1, 5, 10, 25, 50, 100)]
    if args.quick:
        counts = [1, 32, n_pages // 10, n_pages]
    for k in counts:
        few = k <= 32
        it = iters if few else max(3, iters // 10)
        cpu = guarded(run_cpu, t, RegionSpec("r256", RegionKind.OPAQUE, n), k, cpu_iters if few else 3, rng)
        baseline.append({"table": "T6", "region_mib": 256, "dirty_pages": k, **cpu})
        for staging in ("mapped", "device"):
            spec = RegionSpec("r256", RegionKind.OPAQUE, n, diff=DiffMode.HASH)
            g = guarded(run_gpu, t, spec, k, it, staging, rng)
            rows.append({"table": "T6", "region_mib": 256, "dirty_pages": k,
                         "dirty_pct": round(100 * k / n_pages, 3), "mode": "hash", "staging": staging, **g,
                         "cpu_wall_ms": cpu["wall_ms"], "speedup_wall": cpu["wall_ms"] / g["wall_ms"]})

    notes = ("end to end = collect (detect + stage into pinned host memory) + RecoveryLog.append (commit, DRAM "
             "log, fsync never) + advance finished on the GPU (wall_ms; wall_to_commit_ms stops at the commit); "
             "device_ms = GPU time of the collect kernels + the advance kernel, CUDA events in a second pass "
             "where the stream waits on a host flag while the host enqueues (no host launch gaps inside); "
             "wall_ms from Python (perf_counter) with profiling off; medians over iterations; "
             "cpu_* = pinned DtoH of the region + numpy page compare vs host shadow + the same append, same run")
    path = write_results("delta_gpu", rows, baseline=baseline, notes=notes, out_dir=args.out_dir)
    cols = ["table", "region_mib", "dirty_pages", "mode", "staging", "device_collect_ms", "device_ms",
            "wall_to_commit_ms", "wall_ms",
            "cpu_wall_ms", "speedup_wall", "state_pct_of_region"]
    print_table("CPU baseline (same run)", baseline,
                ["table", "region_mib", "dirty_pages", "dtoh_ms", "compare_ms", "wall_ms", "log"])
    print_table("T5/T6 delta checkpoint, GPU handlers (H200)", rows, cols)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
