"""Which way should a log on tmpfs reach the GPU? Host-side rates on this machine, for a file of --gb GB:

- crc: CRC32C of the mapped file on T threads (the verify pass), first touch (faults) and again (mapped);
- memcpy: mapped file -> a pinned ring slot on T threads (the streamed restore's fill);
- register: cuMemHostRegister of the mapping (what a DMA straight from the segment needs), then H2D from it;
- h2d: pinned -> device, one 1 GiB copy.

    python benchmarks/probe_restore_paths.py --gb 4 --threads 1,4,8,16
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--threads", default="1,4,8,16")
    a = ap.parse_args()
    import crc32c
    import torch

    n = int(a.gb * (1 << 30)) // (1 << 20) * (1 << 20)
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="cft-probe-")
    try:
        blk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
        for off in range(0, n, len(blk)):
            os.pwrite(fd, blk[: min(len(blk), n - off)], off)
        out: dict[str, float] = {}
        for t in [int(x) for x in a.threads.split(",")]:
            m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            view = memoryview(m)
            per = -(-n // t) // 4096 * 4096 or 4096
            pieces = [view[i: i + per] for i in range(0, n, per)]
            with ThreadPoolExecutor(t) as ex:
                for label in ("crc_first_touch", "crc_mapped"):
                    t0 = time.perf_counter()
                    list(ex.map(lambda v: crc32c.crc32c(v, gil_release_mode=1), pieces))
                    out[f"{label}_gbps_t{t}"] = n / (time.perf_counter() - t0) / 1e9
                slot = 16 << 20
                ring = torch.empty((2 * t, slot), dtype=torch.uint8, pin_memory=True).numpy()
                chunks = [view[i: i + slot] for i in range(0, n, slot)]

                def fill(i: int, ring: np.ndarray = ring, chunks: list = chunks, depth: int = 2 * t) -> None:
                    c = chunks[i]
                    ring[i % depth, : c.nbytes] = np.frombuffer(c, dtype=np.uint8)

                t0 = time.perf_counter()
                list(ex.map(fill, range(len(chunks))))
                out[f"memcpy_to_pinned_gbps_t{t}"] = n / (time.perf_counter() - t0) / 1e9
            del pieces, chunks, view
            m.close()
            print({k: round(v, 2) for k, v in out.items() if k.endswith(f"t{t}")}, flush=True)
        from concordia_ft.cuda.mapped import register_host_range

        m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        import ctypes

        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        t0 = time.perf_counter()
        reg = register_host_range(addr, n)
        out["register_gbps"] = n / (time.perf_counter() - t0) / 1e9
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        from concordia_ft.cuda import driver

        s = driver.Stream.from_torch(0)
        for label in ("h2d_registered_first_gbps", "h2d_registered_gbps"):
            t0 = time.perf_counter()
            driver.memcpy_htod_async(dev.data_ptr(), addr, n, s)
            s.synchronize()
            out[label] = n / (time.perf_counter() - t0) / 1e9
        reg.close()
        m.close()
        src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        dev[: 1 << 30].copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev[: 1 << 30].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_pinned_gbps"] = (1 << 30) / (time.perf_counter() - t0) / 1e9
        print({k: round(v, 2) for k, v in out.items() if not k.endswith(tuple(f"t{x}" for x in range(99)))})
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
