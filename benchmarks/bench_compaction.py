"""CPU benchmark of compaction and `concordia log check`: memory (tracemalloc peak), time and base size.

    PYTHONPATH=src python benchmarks/bench_compaction.py [--quick] [--dir /dev/shm] [--dense-mib 64]

Two logs on tmpfs: a dense random state (every page live and nonzero: the worst case for memory) and a
sparse one (a 256 MiB initially-zero KV arena with 2% of its blocks written, plus a dense 8 MiB region:
what a serving session looks like). Per log, the streamed compaction (core/snapshot.py, what
`concordia log compact` and the Runtime run) against the baseline a user would otherwise run: the previous
compaction, i.e. replay with every region image built in RAM, then one FULL epoch of every page written
with one vectored write (reproduced here from the public functions). Also `log check` (verify only, no
image) against a replay that builds the images (what it did before). Medians over repeats; each side warmed once (imports, page cache).
Writes benchmarks/results/compaction-cpu.json and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchreport import print_table, write_results

import concordia_ft as cft
from concordia_ft.cli.main import main as cli_main
from concordia_ft.core.compaction import compact_offline
from concordia_ft.core.epochs import plan_epoch
from concordia_ft.core.manifest import load_manifest
from concordia_ft.core.replay import replay
from concordia_ft.core.segment import FileSegment
from concordia_ft.core.tracking import RegionDelta

MiB = 1 << 20
PAGE = 4096


def measure(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, seconds, traced peak MiB) of one call."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            out = fn()
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, seconds, peak / MiB


def build_dense(d: Path, nbytes: int) -> None:
    a = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    with cft.Runtime(d, fsync="never", compact_after_bytes=None) as rt:
        rt.register("state", a, "dense")
        for i in range(4):
            a[i * PAGE : i * PAGE + 8] = i
            rt.checkpoint()


def build_sparse(d: Path) -> None:
    rng = np.random.default_rng(2)
    block = 4 * PAGE
    n_blocks = (256 * MiB) // block
    kv = np.zeros(n_blocks * block, dtype=np.uint8)
    flags = np.zeros(n_blocks, dtype=np.uint8)
    dense = rng.integers(0, 256, 8 * MiB, dtype=np.uint8)
    with cft.Runtime(d, fsync="never", compact_after_bytes=None) as rt:
        rt.register("kv", kv, "paged", block_bytes=block, dirty_blocks=flags, initially_zero=True)
        rt.register("dense", dense, "dense")
        for _ in range(8):
            for b in rng.choice(n_blocks, size=n_blocks // 400, replace=False):
                kv[b * block : (b + 1) * block] = rng.integers(1, 256, block, dtype=np.uint8)
                flags[b] = 1
            dense[::PAGE] += 1
            rt.checkpoint()


def baseline_compact(d: Path) -> int:
    """The previous compaction's work: every image in RAM, then a FULL epoch of every page (not installed)."""
    m = load_manifest(d)
    assert m is not None
    res = replay(d)
    assert res.epoch is not None
    deltas = [RegionDelta(img.spec, np.arange(img.spec.n_pages, dtype=np.int64), img.padded.data.cast("B"))
              for img in res.regions.values()]
    tmp = d / "baseline-base.tmp"
    seg = FileSegment(tmp, create_with=bytes(4096), prealloc=False)
    try:
        plan = plan_epoch(res.epoch, seg.end, defs=[i.spec for i in res.regions.values()], drops=[],
                          deltas=deltas, meta=res.meta, full=True)
        seg.append(plan.parts)
        seg.sync()
        size = seg.end
    finally:
        seg.close()
        tmp.unlink()
    return size


def bench_log(root: Path, name: str, build: Callable[[Path], None], repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in
                                                       ("streamed", "baseline", "check", "check-baseline")}
    log_bytes = 0
    for _ in range(repeats):
        d = root / f"cft-bench-compact-{uuid.uuid4().hex[:8]}"
        try:
            build(d)
            log_bytes = sum(p.stat().st_size for p in d.glob("*.cft"))
            with contextlib.redirect_stdout(io.StringIO()):  # warm: imports and page cache, for both sides
                cli_main(["log", "check", str(d)])
                replay(d, materialize=False).close()
            rc, s, peak = measure(lambda d=d: cli_main(["log", "check", str(d)]))
            assert rc == 0
            runs["check"].append((s, peak, 0))
            _, s, peak = measure(lambda d=d: replay(d))
            runs["check-baseline"].append((s, peak, 0))
            size, s, peak = measure(lambda d=d: baseline_compact(d))
            runs["baseline"].append((s, peak, size))
            r, s, peak = measure(lambda d=d: compact_offline(d))
            assert r.compacted
            runs["streamed"].append((s, peak, r.bytes_after))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    for kind, label in (("streamed", "compaction, streamed + sparse"), ("baseline", "compaction, images in RAM"),
                        ("check", "log check (verify, no image)"), ("check-baseline", "replay building images")):
        xs = runs[kind]
        rows.append({"log": name, "case": label, "log_mib": round(log_bytes / MiB, 1),
                     "seconds": round(statistics.median(x[0] for x in xs), 3),
                     "peak_traced_mib": round(statistics.median(x[1] for x in xs), 2),
                     "base_mib": round(statistics.median(x[2] for x in xs) / MiB, 2) if xs[0][2] else None,
                     "repeats": len(xs), "baseline": kind.endswith("baseline")})
    new, old = rows[0], rows[1]
    new["memory_ratio_vs_baseline"] = round(old["peak_traced_mib"] / max(new["peak_traced_mib"], 1e-3), 1)
    new["time_ratio_vs_baseline"] = round(new["seconds"] / old["seconds"], 2)
    new["base_ratio_vs_baseline"] = round(old["base_mib"] / max(new["base_mib"], 1e-3), 1)
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--dense-mib", type=int, default=64)
    p.add_argument("--out-dir", default="benchmarks/results")
    a = p.parse_args(argv)
    root = Path(a.dir)
    reps = 1 if a.quick else 3
    rows = bench_log(root, f"dense {a.dense_mib} MiB random", lambda d: build_dense(d, a.dense_mib * MiB), reps)
    rows += bench_log(root, "sparse: 256 MiB zero arena (2% written) + 8 MiB dense", build_sparse, reps)
    ours = [r for r in rows if not r["baseline"]]
    base = [r for r in rows if r["baseline"]]
    notes = ("CPU only, tmpfs. peak_traced_mib = tracemalloc peak of the call (numpy allocations are traced; the "
             "mapped segments are not allocations). Baseline = the compaction before this change (every region "
             "image built in RAM, every page written) and a replay that builds images (what `log check` did).")
    path = write_results("compaction", ours, baseline=base, notes=notes, out_dir=a.out_dir, tag="cpu")
    print(f"wrote {path}")
    print_table("compaction and check, CPU (baseline rows: the previous way, same run)", rows,
                ["log", "case", "log_mib", "seconds", "peak_traced_mib", "base_mib", "baseline"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
