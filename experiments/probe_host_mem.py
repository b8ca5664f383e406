"""Host-side facts that bound recovery time on this machine: memcpy into fresh vs pre-faulted memory,
CRC32C throughput (one thread, many threads, small and large buffers), pinned allocation cost, and H2D
from pageable vs pinned memory.

Usage: python experiments/probe_host_mem.py [--mb 232] [--out-dir experiments/results]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
import benchreport  # noqa: E402


def gbs(nbytes: int, fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=232)
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--tag", default=None)
    a = ap.parse_args()
    n = a.mb << 20
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    rows = []
    rows.append({"what": "memcpy into fresh np.empty", "gb_s": gbs(n, lambda: np.empty_like(src).__setitem__(slice(None), src))})
    dst = np.empty_like(src)
    dst[:] = 0
    rows.append({"what": "memcpy into pre-faulted memory", "gb_s": gbs(n, lambda: np.copyto(dst, src))})
    rows.append({"what": "np.empty + page touch (first-touch fault cost)", "gb_s": gbs(n, lambda: np.empty_like(src).fill(1))})
    rows.append({"what": "crc32c one buffer, one thread", "gb_s": gbs(n, lambda: crc32c.crc32c(src))})
    chunks = [src[i:i + (112 << 10)] for i in range(0, n, 112 << 10)]
    for th in (1, 2, 4, 8, 16):
        for mode in (0, 1):
            with ThreadPoolExecutor(th) as ex:
                def crc(c: np.ndarray, mode: int = mode) -> int:
                    return int(crc32c.crc32c(c, gil_release_mode=mode))
                list(ex.map(crc, chunks[:64]))
                rows.append({"what": f"crc32c 112 KiB chunks, {th} threads, gil_release_mode={mode}",
                             "gb_s": gbs(n, lambda ex=ex, crc=crc: list(ex.map(crc, chunks)))})
    big = [src[i:i + (8 << 20)] for i in range(0, n, 8 << 20)]
    for th in (1, 4, 8, 16):
        with ThreadPoolExecutor(th) as ex:
            rows.append({"what": f"crc32c 8 MiB chunks, {th} threads", "gb_s": gbs(n, lambda: list(ex.map(lambda c: crc32c.crc32c(c, gil_release_mode=1), big)))})
            rows.append({"what": f"memcpy 8 MiB chunks into pre-faulted, {th} threads",
                         "gb_s": gbs(n, lambda: list(ex.map(lambda i: np.copyto(dst[i:i + (8 << 20)], src[i:i + (8 << 20)]), range(0, n, 8 << 20))))})
    try:
        import torch
        if torch.cuda.is_available():
            t = time.perf_counter()
            pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            rows.append({"what": "pinned alloc (torch pin_memory)", "ms": 1e3 * (time.perf_counter() - t)})
            pin.numpy()[:] = src
            d = torch.empty(n, dtype=torch.uint8, device="cuda")
            for label, h in (("pageable", torch.from_numpy(src)), ("pinned", pin)):
                d.copy_(h, non_blocking=True)
                torch.cuda.synchronize()
                t = time.perf_counter()
                d.copy_(h, non_blocking=True)
                torch.cuda.synchronize()
                rows.append({"what": f"H2D from {label}", "gb_s": n / (time.perf_counter() - t) / 1e9})
    except ImportError:
        pass
    path = benchreport.write_results("host_mem", rows, notes=f"{a.mb} MiB buffers", out_dir=a.out_dir, tag=a.tag)
    benchreport.print_table("host memory facts", rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
