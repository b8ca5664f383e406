"""Which way should a log on tmpfs reach the GPU? Host-side rates on this machine, for a file of --gb GB:

- memcpy: mapped file -> a ring of pinned 16 MiB slots on T threads (the streamed restore's fill), from a fresh
  mapping (first-touch page faults), again (pages mapped), and after MADV_POPULATE_READ (its own rate too);
- crc: CRC32C of a fresh mapping on T threads (the host verify);
- register: cuMemHostRegister of a fresh mapping (what a DMA straight from the segment needs), whole and in
  256 MiB pieces on T threads, cuMemHostUnregister, and H2D from the registered range;
- h2d: pinned -> device, one 1 GiB copy;
- pread vs the fill's streaming-store copy (``_ntcopy.copy``, the restore's default) from a fresh mapping: the
  file read into the slots with ``pread`` (no page faults on the source: the kernel copies from the page cache
  through its own map), each alone and while a DMA stream (1 GiB pinned -> device, repeated) runs beside it, as
  in a restore; the DMA's own rate is reported beside (``--dma``).

Writes a results JSON (``--out``) beside printing.

    python experiments/probe_restore_paths.py --gb 2 --threads 8,16 --out experiments/results
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

MADV_POPULATE_READ = 22
SLOT = 16 << 20


def _addr(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def copy_all(ex: ThreadPoolExecutor, view: memoryview, ring: np.ndarray, n: int) -> None:
    depth = len(ring)

    def fill(i: int) -> None:
        ring[i % depth] = np.frombuffer(view[i * SLOT:(i + 1) * SLOT], dtype=np.uint8)

    list(ex.map(fill, range(n // SLOT)))


def nt_copy_all(ex: ThreadPoolExecutor, view: memoryview, ring: np.ndarray, n: int) -> None:
    from concordia_ft.core import _ntcopy  # type: ignore[attr-defined]

    depth = len(ring)

    def fill(i: int) -> None:
        _ntcopy.copy(ring[i % depth], view[i * SLOT:(i + 1) * SLOT])

    list(ex.map(fill, range(n // SLOT)))


def pread_all(ex: ThreadPoolExecutor, fd: int, ring: np.ndarray, n: int) -> None:
    depth = len(ring)

    def fill(i: int) -> None:
        dst = memoryview(ring[i % depth])
        got = os.preadv(fd, [dst], i * SLOT)
        if got != SLOT:
            raise OSError(f"short read: {got} of {SLOT} bytes at {i * SLOT}")

    list(ex.map(fill, range(n // SLOT)))


class DmaBeside:
    """Repeated 1 GiB pinned -> device copies on a stream of their own while the host side is timed."""

    def __init__(self, torch: Any, dev: Any) -> None:
        import threading

        self.torch, self.dev = torch, dev
        self.src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.copies = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.dev[: 1 << 30].copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.copies += 1

    def __enter__(self) -> DmaBeside:
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.gbps = round(self.copies * (1 << 30) / (time.perf_counter() - self.t0) / 1e9, 2)


def populate(ex: ThreadPoolExecutor, libc: Any, base: int, n: int) -> None:
    def one(i: int) -> None:
        if libc.madvise(base + i * SLOT, SLOT, MADV_POPULATE_READ) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")

    list(ex.map(one, range(n // SLOT)))


def crc_all(ex: ThreadPoolExecutor, pieces: list[memoryview]) -> None:
    import crc32c

    list(ex.map(lambda x: crc32c.crc32c(x, gil_release_mode=1), pieces))


def register_pieces(ex: ThreadPoolExecutor, addr: int, n: int, piece: int, regs: list[Any]) -> None:
    from concordia_ft.cuda.mapped import register_host_range

    regs.extend(ex.map(lambda o: register_host_range(addr + o, min(piece, n - o)), range(0, n, piece)))


def unregister_all(ex: ThreadPoolExecutor, regs: list[Any]) -> None:
    list(ex.map(lambda r: r.close(), regs))


def probe_register(fd: int, n: int, dev: Any, out: dict[str, Any], threads: list[int]) -> None:
    from concordia_ft.cuda import driver
    from concordia_ft.cuda.mapped import register_host_range

    def fresh() -> tuple[mmap.mmap, memoryview]:
        m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return m, memoryview(m)

    s = driver.Stream.from_torch(0)
    m, v = fresh()
    addr = _addr(m)
    reg: list[Any] = []
    _timed(out, n, "register_whole_gbps", lambda: reg.append(register_host_range(addr, n)))
    for label in ("h2d_registered_first_gbps", "h2d_registered_gbps"):
        def h2d() -> None:
            driver.memcpy_htod_async(dev.data_ptr(), addr, n, s)
            s.synchronize()
        _timed(out, n, label, h2d)
    _timed(out, n, "unregister_whole_gbps", lambda: reg.pop().close())
    del v
    m.close()
    # the replay maps segments read-only: a DMA straight from them needs a READ_ONLY registration
    drv = driver.bindings()
    mro = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
    ro = np.frombuffer(mro, dtype=np.uint8).ctypes.data
    flags = drv.CU_MEMHOSTREGISTER_PORTABLE | drv.CU_MEMHOSTREGISTER_READ_ONLY
    t0 = time.perf_counter()
    err = drv.cuMemHostRegister(ro, n, flags)[0]
    out["register_read_only_result"] = driver.error_name(int(err))
    if int(err) == 0:
        out["register_read_only_gbps"] = round(n / (time.perf_counter() - t0) / 1e9, 2)
        t0 = time.perf_counter()
        driver.memcpy_htod_async(dev.data_ptr(), ro, n, s)
        s.synchronize()
        out["h2d_read_only_registered_gbps"] = round(n / (time.perf_counter() - t0) / 1e9, 2)
        drv.cuMemHostUnregister(ro)
    del ro
    mro.close()
    for t in threads:
        m, v = fresh()
        addr = _addr(m)
        regs: list[Any] = []
        with ThreadPoolExecutor(t) as ex:
            _timed(out, n, f"register_256m_gbps_t{t}", register_pieces, ex, addr, n, 256 << 20, regs)
            _timed(out, n, f"unregister_256m_gbps_t{t}", unregister_all, ex, regs)
        del v
        m.close()



def _timed(out: dict[str, Any], n: int, label: str, fn: Callable[..., Any], *args: Any) -> None:
    t0 = time.perf_counter()
    fn(*args)
    out[label] = round(n / (time.perf_counter() - t0) / 1e9, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dma", action=argparse.BooleanOptionalAction, default=True,
                    help="also time pread and the streaming copy while a DMA stream runs beside them")
    a = ap.parse_args()
    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = int(a.gb * (1 << 30)) // SLOT * SLOT
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="cft-probe-")
    out: dict[str, Any] = {"bytes": n}

    def fresh() -> tuple[mmap.mmap, memoryview]:
        m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return m, memoryview(m)

    def timed(label: str, fn: Callable[..., Any], *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        out[label] = round(n / (time.perf_counter() - t0) / 1e9, 2)

    try:
        blk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
        for off in range(0, n, len(blk)):
            os.pwrite(fd, blk[: min(len(blk), n - off)], off)
        for t in [int(x) for x in a.threads.split(",")]:
            ring = torch.empty((2 * t, SLOT), dtype=torch.uint8, pin_memory=True).numpy()
            with ThreadPoolExecutor(t) as ex:
                m, v = fresh()
                timed(f"memcpy_first_touch_gbps_t{t}", copy_all, ex, v, ring, n)
                timed(f"memcpy_mapped_gbps_t{t}", copy_all, ex, v, ring, n)
                del v
                m.close()
                m, v = fresh()
                base = _addr(m)
                try:
                    timed(f"populate_read_gbps_t{t}", populate, ex, libc, base, n)
                    timed(f"memcpy_after_populate_gbps_t{t}", copy_all, ex, v, ring, n)
                except OSError as e:
                    out[f"populate_read_error_t{t}"] = str(e)
                del v
                m.close()
                try:
                    m, v = fresh()
                    timed(f"ntcopy_first_touch_gbps_t{t}", nt_copy_all, ex, v, ring, n)
                    del v
                    m.close()
                except ImportError as e:
                    out[f"ntcopy_error_t{t}"] = repr(e)
                timed(f"pread_gbps_t{t}", pread_all, ex, fd, ring, n)
                if a.dma:
                    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
                    with DmaBeside(torch, dev) as dma:
                        timed(f"pread_with_dma_gbps_t{t}", pread_all, ex, fd, ring, n)
                    out[f"pread_dma_beside_gbps_t{t}"] = dma.gbps
                    if f"ntcopy_error_t{t}" not in out:
                        m, v = fresh()
                        with DmaBeside(torch, dev) as dma:
                            timed(f"ntcopy_first_touch_with_dma_gbps_t{t}", nt_copy_all, ex, v, ring, n)
                        out[f"ntcopy_first_touch_dma_beside_gbps_t{t}"] = dma.gbps
                        del v
                        m.close()
                    del dev
                m, v = fresh()
                per = n // t // 4096 * 4096
                pieces = [v[i: i + per] for i in range(0, n, per)]
                timed(f"crc_first_touch_gbps_t{t}", crc_all, ex, pieces)
                del pieces, v
                m.close()
            print({k: v for k, v in out.items() if k.endswith(f"t{t}")}, flush=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        dev[: 1 << 30].copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev[: 1 << 30].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_pinned_gbps"] = round((1 << 30) / (time.perf_counter() - t0) / 1e9, 2)
        try:
            probe_register(fd, n, dev, out, [int(x) for x in a.threads.split(",")][:1] + [4])
        except Exception as e:  # noqa: BLE001 - a probe: record what failed, keep the rest
            out["register_error"] = repr(e)
        print({k: v for k, v in out.items() if "_t" not in k or k.startswith(("register", "unregister"))},
              flush=True)
    finally:
        os.close(fd)
        os.unlink(path)
    if a.out:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
        from benchreport import write_results

        print("wrote", write_results("restore_paths", [out], baseline=[], notes=__doc__.split("\n\n")[0],
                                     out_dir=a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
