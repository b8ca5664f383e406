"""CPU benchmark of the recovery log: append latency/throughput, replay, compaction, CPU dirty detection, fsync.

    PYTHONPATH=src python benchmarks/bench_log.py [--quick] [--file-dir /var/tmp] [--max-region-mib 1024]

Backends: 'dram' = a directory on /dev/shm (tmpfs), 'file' = a directory on an ordinary disk (--file-dir).
Every number is a median over repeats. Baselines measured in the same run: a raw pwrite of the same bytes,
crc32c alone, and a full np.copyto of the region (what a checkpoint without dirty tracking copies).
Writes benchmarks/results/log-cpu.json and prints the table last. Peak memory stays under ~5 GiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchreport import print_table, write_results

from concordia_ft.core.checksums import crc32c
from concordia_ft.core.compaction import compact_offline
from concordia_ft.core.log import RecoveryLog
from concordia_ft.core.regions import DiffMode, RegionKind, RegionSpec
from concordia_ft.core.replay import replay
from concordia_ft.core.tracking import RegionDelta
from concordia_ft.cpu.trackers import CpuTracker

MiB = 1 << 20
PAGE = 4096


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def fresh_dir(root: Path, tag: str) -> Path:
    d = root / f"cft-bench-{tag}-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    return d


def row(section: str, case: str, value: float, unit: str, *, backend: str = "", fsync: str = "",
        target: str = "", meets: bool | None = None, **extra: Any) -> dict[str, Any]:
    r = {"section": section, "case": case, "backend": backend, "fsync": fsync, "value": round(value, 4),
         "unit": unit, "target": target, "meets": "" if meets is None else ("yes" if meets else "NO")}
    r.update(extra)
    return r


# ------------------------------------------------------------------------------------------------ appends
def bench_one_page(root: Path, backend: str, fsync: str, repeats: int) -> dict[str, Any]:
    """(a) one dirty 4 KiB page of a 256 MiB region: the delta is staged first; only log.append is timed."""
    d = fresh_dir(root, "page")
    spec = RegionSpec("big", RegionKind.OPAQUE, 256 * MiB, PAGE)
    rng = np.random.default_rng(0)
    page = rng.integers(0, 256, PAGE, dtype=np.uint8)
    log = RecoveryLog.open(d, {"fsync": fsync, "backend": backend if backend == "dram" else "file"})
    try:
        log.append(defs=[spec])
        times = time_appends(log, lambda: RegionDelta(spec, np.array([int(rng.integers(0, spec.n_pages))], np.int64),
                                                      memoryview(page)), repeats)
    finally:
        log.close()
        shutil.rmtree(d, ignore_errors=True)
    us = med(times) * 1e6
    target = "<= 50 us" if fsync == "never" else ""
    return row("append", "1 dirty 4 KiB page of a 256 MiB region", us, "us", backend=backend, fsync=fsync,
               target=target, meets=(us <= 50) if fsync == "never" else None,
               p90_us=round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e6, 2), repeats=repeats)


def time_appends(log: RecoveryLog, make_delta: Callable[[], RegionDelta], repeats: int, gap_s: float = 0.0
                 ) -> list[float]:
    """Seconds each ``log.append`` of a fresh delta took (the delta is built outside the timed part)."""
    times = []
    for _ in range(repeats):
        delta = make_delta()
        time.sleep(gap_s)
        t0 = time.perf_counter()
        log.append(deltas=[delta])
        times.append(time.perf_counter() - t0)
    return times


def bench_dense(root: Path, backend: str, fsync: str, size: int, repeats: int, gap_s: float = 0.0) -> dict[str, Any]:
    """(b) dense epochs: every page of a ``size`` region, payload passed by reference (CRC + one write).

    ``gap_s`` > 0 paces the epochs (a checkpoint cadence): the log's background reservation then allocates the
    next epoch's pages before it arrives; back to back (0), appends also pay for allocating fresh pages."""
    d = fresh_dir(root, "dense")
    spec = RegionSpec("dense", RegionKind.DENSE, size, PAGE)
    buf = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    pages = np.arange(spec.n_pages, dtype=np.int64)
    log = RecoveryLog.open(d, {"fsync": fsync, "backend": backend if backend == "dram" else "file",
                               "segment_max_bytes": 4 << 30})
    try:
        log.append(defs=[spec])
        def next_version() -> RegionDelta:
            buf[::PAGE] += 1  # a new version each epoch
            return RegionDelta(spec, pages, memoryview(buf))

        times = time_appends(log, next_version, repeats, gap_s)
    finally:
        log.close()
        shutil.rmtree(d, ignore_errors=True)
    gbps = size / med(times) / 1e9
    is_target = backend == "dram" and fsync == "never"
    case = f"{size // MiB} MiB dense epoch" + (f", {gap_s * 1e3:.0f} ms apart" if gap_s else ", back to back")
    return row("append", case, gbps, "GB/s", backend=backend, fsync=fsync,
               target=">= 3 GB/s (DRAM, with CRC)" if is_target else "", meets=(gbps >= 3) if is_target else None,
               median_ms=round(med(times) * 1e3, 3), repeats=repeats)


def baseline_raw_write(root: Path, backend: str, size: int, repeats: int) -> dict[str, Any]:
    """The floor: pwrite of the same bytes into a preallocated file, no CRC, no format."""
    d = fresh_dir(root, "raw")
    buf = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    fd = os.open(d / "raw", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size * (repeats + 1))
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            os.pwrite(fd, memoryview(buf), i * size)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
    return row("baseline", f"raw pwrite of {size // MiB} MiB (no CRC, no format)", size / med(times) / 1e9, "GB/s",
               backend=backend)


def baseline_crc(size: int, repeats: int) -> dict[str, Any]:
    buf = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        crc32c(memoryview(buf))
        times.append(time.perf_counter() - t0)
    return row("baseline", f"crc32c of {size // MiB} MiB", size / med(times) / 1e9, "GB/s")


# ------------------------------------------------------------------------------------- replay & compaction
def bench_replay_and_compaction(root: Path, epoch_bytes: int, n_epochs: int, repeats: int) -> list[dict[str, Any]]:
    d = fresh_dir(root, "replay")
    spec_a = RegionSpec("a", RegionKind.DENSE, epoch_bytes // 2, PAGE)
    spec_b = RegionSpec("b", RegionKind.OPAQUE, epoch_bytes // 2, PAGE)
    rng = np.random.default_rng(4)
    a = rng.integers(0, 256, spec_a.nbytes, dtype=np.uint8)
    b = rng.integers(0, 256, spec_b.nbytes, dtype=np.uint8)
    out = []
    try:
        with RecoveryLog.open(d, {"fsync": "never", "backend": "dram", "segment_max_bytes": 8 << 30}) as log:
            all_a = np.arange(spec_a.n_pages, dtype=np.int64)
            for i in range(n_epochs):
                a[::PAGE] += 1
                b[::PAGE] += 1
                log.append(defs=[spec_a, spec_b] if i == 0 else [],
                           deltas=[RegionDelta(spec_a, all_a, memoryview(a)), RegionDelta(spec_b, all_a, memoryview(b))])
        for verify in (True, False):
            times, nbytes = [], 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = replay(d, verify_payloads=verify)
                times.append(time.perf_counter() - t0)
                nbytes = res.bytes_read
                assert res.epoch == n_epochs
                del res
            gbps = nbytes / med(times) / 1e9
            out.append(row("replay", f"{n_epochs} x {epoch_bytes // MiB} MiB epochs, "
                           + ("payload CRCs verified" if verify else "no payload CRC (reference)"),
                           gbps, "GB/s", backend="dram", target=">= 3 GB/s" if verify else "",
                           meets=(gbps >= 3) if verify else None, median_ms=round(med(times) * 1e3, 2),
                           log_bytes=nbytes))
        r = compact_offline(d)
        assert r.compacted
        out.append(row("compaction", f"{n_epochs} x {epoch_bytes // MiB} MiB epochs -> one base",
                       r.bytes_before / r.seconds / 1e9, "GB/s (log bytes in)", backend="dram",
                       seconds=round(r.seconds, 3), bytes_before=r.bytes_before, bytes_after=r.bytes_after))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------- dirty detection
def bench_detection(size: int, diff: str, dirty_frac: float, repeats: int) -> dict[str, Any]:
    spec = RegionSpec("r", RegionKind.OPAQUE, size, PAGE, diff=DiffMode(diff))
    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, size, dtype=np.uint8)
    tr = CpuTracker(spec, buf)
    tr.advance(tr.collect(full=True))
    n_dirty = max(1, int(spec.n_pages * dirty_frac))
    times = []
    for _ in range(repeats):
        pages = np.sort(rng.choice(spec.n_pages, n_dirty, replace=False))
        buf[pages * PAGE] += 1
        t0 = time.perf_counter()
        d = tr.collect(full=False)
        times.append(time.perf_counter() - t0)
        assert len(d.pages) == n_dirty
        tr.advance(d)
        del d
    tr.close()
    del buf
    s = med(times)
    return row("detect", f"opaque {diff}: {size // MiB} MiB, {n_dirty} dirty pages (collect + gather)",
               size / s / 1e9, "GB/s scanned", median_ms=round(s * 1e3, 2), repeats=repeats)


def baseline_full_copy(size: int, repeats: int) -> dict[str, Any]:
    src = np.random.default_rng(6).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return row("baseline", f"full copy (np.copyto) of {size // MiB} MiB", size / med(times) / 1e9, "GB/s",
               median_ms=round(med(times) * 1e3, 2))


# ------------------------------------------------------------------------------------------------- fsync
def bench_fsync(root: Path, backend: str, repeats: int) -> dict[str, Any]:
    d = fresh_dir(root, "fsync")
    fd = os.open(d / "f", os.O_RDWR | os.O_CREAT, 0o644)
    data = os.urandom(PAGE)
    times = []
    try:
        for i in range(repeats):
            os.pwrite(fd, data, i * PAGE)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
    return row("fsync", "fdatasync after a 4 KiB append", med(times) * 1e6, "us", backend=backend,
               p90_us=round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e6, 1))


def loss_windows(fsync_us: float, interval_ms: int) -> list[dict[str, Any]]:
    def read(name: str) -> int:
        try:
            return int(Path(f"/proc/sys/vm/{name}").read_text())
        except OSError:
            return -1

    expire_cs, writeback_cs = read("dirty_expire_centisecs"), read("dirty_writeback_centisecs")
    never_ms = (expire_cs + writeback_cs) * 10 if expire_cs >= 0 and writeback_cs >= 0 else -1
    return [
        row("loss window", "fsync=always (power cut / kernel crash)", 0.0, "ms", fsync="always",
            note="nothing checkpoint() returned; each epoch pays one fdatasync"),
        row("loss window", f"fsync=interval ({interval_ms} ms)", interval_ms + fsync_us / 1e3, "ms", fsync="interval",
            note="interval + one fdatasync"),
        row("loss window", "fsync=never", float(never_ms), "ms", fsync="never",
            note=f"vm.dirty_expire_centisecs={expire_cs} + dirty_writeback_centisecs={writeback_cs}"),
        row("loss window", "any policy, process SIGKILL", 0.0, "ms",
            note="bytes are in the page cache once append returns (tests/test_crash_kill.py)"),
    ]


# -------------------------------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a smoke run)")
    p.add_argument("--file-dir", default="/var/tmp", help="a directory on an ordinary disk for the 'file' backend")
    p.add_argument("--dram-dir", default="/dev/shm")
    p.add_argument("--max-region-mib", type=int, default=1024)
    p.add_argument("--out-dir", default="benchmarks/results")
    a = p.parse_args(argv)
    roots = {"dram": Path(a.dram_dir), "file": Path(a.file_dir)}
    q = a.quick
    rows: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []

    for backend, root in roots.items():
        for fsync in ("never", "interval", "always"):
            rows.append(bench_one_page(root, backend, fsync, 50 if q else 400))
    dense = 64 * MiB
    for backend, root in roots.items():
        for fsync in ("never", "always"):
            rows.append(bench_dense(root, backend, fsync, dense, 3 if q else 9))
            rows.append(bench_dense(root, backend, fsync, dense, 3 if q else 9, gap_s=0.05))
        base.append(baseline_raw_write(root, backend, dense, 3 if q else 9))
    base.append(baseline_crc(dense, 3 if q else 9))
    rows += bench_replay_and_compaction(roots["dram"], 64 * MiB, 4 if q else 8, 2 if q else 5)
    sizes = [16, 64, 256, 1024]
    sizes = [s for s in sizes if s <= a.max_region_mib and (not q or s <= 64)]
    for s in sizes:
        reps = 3 if s >= 1024 else (5 if s >= 256 else 9)
        for diff in ("shadow", "hash"):
            rows.append(bench_detection(s * MiB, diff, 0.01, reps))
        base.append(baseline_full_copy(s * MiB, reps))
    fs = {b: bench_fsync(r, b, 30 if q else 200) for b, r in roots.items()}
    rows += list(fs.values())
    rows += loss_windows(fs["file"]["value"], 100)

    notes = ("CPU only (2 cores). 'dram' = tmpfs (/dev/shm), 'file' = " + str(roots["file"]) + ". Appends time "
             "RecoveryLog.append only (delta staged before). Detection = CpuTracker.collect(full=False) with 1% of "
             "pages dirty (scan + gather). Medians over repeats.")
    path = write_results("log", rows, baseline=base, notes=notes, out_dir=a.out_dir, tag="cpu")
    print(f"wrote {path}")
    cols = ["section", "case", "backend", "fsync", "value", "unit", "target", "meets"]
    print_table("baseline (same run)", base, ["section", "case", "backend", "value", "unit"])
    print_table("recovery log, CPU", rows, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
