"""Can a log kept in pinned host memory outlive the process that wrote it, and how fast does a new one reach it?

A streamed restore today copies every byte three times through host memory: from the log's tmpfs mapping into a
pinned ring, then the DMA reads the ring (serve/DESIGN.md: 34-38 GB/s against 55 GB/s of pinned H2D on the
H200 hosts). Registering the tmpfs pages for DMA runs at 8-16 GB/s (the driver serialises it). This probe checks
the other way round: log memory that is pinned from the start, allocated through the driver's virtual memory
API on the host (``cuMemCreate`` with a host NUMA location, exportable as a POSIX file descriptor), held by a
process with no CUDA context at all (a *keeper*) so that a SIGKILL of the writer leaves it intact, and imported
by a fresh process that DMAs from it with no host copy.

Three processes, real ones: the keeper (this script with ``--keeper``), a writer (``--writer``) that allocates
``--gb`` GiB in 1 GiB handles, fills them with random bytes, sends the descriptors to the keeper and is SIGKILLed,
and a reader (``--reader``) that takes the descriptors from the keeper and times import, map, access, H2D from
the imported memory, a kernel reading it in place (cupy, zero copy), and the same H2D from ordinary pinned
memory (the baseline), then checks every byte's sum against the writer's. Writes a results JSON (``--out``).

    python experiments/probe_host_vmm.py --gb 8 --out experiments/results
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

GIB = 1 << 30


def _drv() -> Any:
    from cuda.bindings import driver as d

    return d


def _ok(res: Any, what: str) -> Any:
    d = _drv()
    err = res[0] if isinstance(res, tuple) else res
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err!r}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


def _ctx() -> Any:
    d = _drv()
    _ok(d.cuInit(0), "cuInit")
    dev = _ok(d.cuDeviceGet(0), "cuDeviceGet")
    ctx = _ok(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _ok(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev


def _attrs(dev: Any) -> dict[str, int]:
    d = _drv()
    out = {}
    for name in ("HOST_NUMA_ID", "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                 "NUMA_CONFIG", "NUMA_ID", "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
        a = getattr(d.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}", None)
        if a is not None:
            err, v = d.cuDeviceGetAttribute(a, dev)
            out[name.lower()] = int(v) if err == d.CUresult.CUDA_SUCCESS else -1
    return out


def _prop(numa: int) -> Any:
    d = _drv()
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    p.location.id = numa
    p.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p


def _access(dev_ordinal: int) -> list[Any]:
    d = _drv()
    host = d.CUmemAccessDesc()
    host.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    host.location.id = 0
    host.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    dv = d.CUmemAccessDesc()
    dv.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    dv.location.id = dev_ordinal
    dv.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return [host, dv]


def _map(handles: list[Any], piece: int, which: str = "both", times: dict[str, float] | None = None) -> int:
    """Reserve one range for all handles, map them back to back, grant access (``which``: "both", "device",
    "host"); its address. ``times`` gets the seconds of the maps and of the access grant."""
    d = _drv()
    n = piece * len(handles)
    va = int(_ok(d.cuMemAddressReserve(n, 0, 0, 0), "cuMemAddressReserve"))
    t0 = time.perf_counter()
    for i, h in enumerate(handles):
        _ok(d.cuMemMap(va + i * piece, piece, 0, h, 0), "cuMemMap")
    t1 = time.perf_counter()
    acc = _access(0)
    acc = {"both": acc, "host": acc[:1], "device": acc[1:]}[which]
    _ok(d.cuMemSetAccess(va, n, acc, len(acc)), "cuMemSetAccess")
    if times is not None:
        times["map_s"] = round(t1 - t0, 4)
        times["access_s"] = round(time.perf_counter() - t1, 4)
    return va


def _unmap(va: int, n: int) -> None:
    d = _drv()
    _ok(d.cuMemUnmap(va, n), "cuMemUnmap")
    _ok(d.cuMemAddressFree(va, n), "cuMemAddressFree")


def _view(va: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(va))


def keeper(sock_path: str) -> int:
    """Hold the writer's descriptors (no CUDA here) and hand them to each reader that asks."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(4)
    fds: list[int] = []
    meta = b"{}"
    while True:
        c, _ = srv.accept()
        with c:
            msg, got, _, _ = socket.recv_fds(c, 1 << 16, 64)
            if msg.startswith(b"put"):
                fds, meta = got, msg[3:]
                c.sendall(b"ok")
            elif msg.startswith(b"get"):
                socket.send_fds(c, [meta], fds)
            elif msg.startswith(b"quit"):
                return 0


def writer(sock_path: str, gb: int) -> int:
    d = _drv()
    dev = _ctx()
    out: dict[str, Any] = {"attrs": _attrs(dev)}
    numa = max(0, out["attrs"].get("host_numa_id", 0))
    p = _prop(numa)
    gran = int(_ok(d.cuMemGetAllocationGranularity(p, d.CUmemAllocationGranularity_flags.
                                                  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity"))
    out["granularity"] = gran
    piece = max(GIB // gran, 1) * gran
    t0 = time.perf_counter()
    handles = [_ok(d.cuMemCreate(piece, p, 0), "cuMemCreate") for _ in range(gb)]
    out["create_gbps"] = round(piece * gb / (time.perf_counter() - t0) / 1e9, 2)
    t0 = time.perf_counter()
    va = _map(handles, piece)
    out["map_access_s"] = round(time.perf_counter() - t0, 4)
    n = piece * gb
    buf = _view(va, n)
    blk = np.random.default_rng(int.from_bytes(os.urandom(4), "little")).integers(0, 256, 64 << 20, dtype=np.uint8)
    t0 = time.perf_counter()
    for off in range(0, n, len(blk)):
        k = min(len(blk), n - off)
        buf[off:off + k] = blk[:k]
        buf[off:off + 8] = np.frombuffer(np.uint64(off ^ 0x5DEECE66D).tobytes(), dtype=np.uint8)
    out["cpu_write_gbps"] = round(n / (time.perf_counter() - t0) / 1e9, 2)
    with np.errstate(over="ignore"):
        total = np.sum(buf.view(np.uint64), dtype=np.uint64)
    out["sum"] = int(total)
    # the rates a log writer would see storing into this memory: memcpy (numpy) and streaming stores, one and
    # four threads, from an ordinary buffer already in memory, into the last GiB (its bytes restored after)
    src = np.empty(piece, dtype=np.uint8)
    src[:] = buf[n - piece:]
    dst = buf[n - piece:]
    try:
        from concurrent.futures import ThreadPoolExecutor

        from concordia_ft.core import _ntcopy  # type: ignore[attr-defined]

        for label, fn in (("memcpy", lambda a, b: np.copyto(a, b)), ("nt", _ntcopy.copy)):
            for t in (1, 4):
                step = piece // t
                with ThreadPoolExecutor(t) as ex:
                    t0 = time.perf_counter()
                    list(ex.map(lambda i, f=fn, k=step: f(dst[i * k:(i + 1) * k], src[i * k:(i + 1) * k]),
                                range(t)))
                    out[f"write_{label}_t{t}_gbps"] = round(piece / (time.perf_counter() - t0) / 1e9, 2)
            # the same into ordinary (pageable, already touched) memory: the comparison
            plain = np.empty(piece, dtype=np.uint8)
            plain[:] = 1
            t0 = time.perf_counter()
            fn(plain, src)
            out[f"write_{label}_t1_ordinary_gbps"] = round(piece / (time.perf_counter() - t0) / 1e9, 2)
    except Exception as e:  # noqa: BLE001 - a probe: record what failed, keep the rest
        out["write_error"] = repr(e)[:300]
    dst[:] = src
    t0 = time.perf_counter()
    fds = [int(_ok(d.cuMemExportToShareableHandle(
        h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export")) for h in handles]
    out["export_s"] = round(time.perf_counter() - t0, 4)
    out.update(piece=piece, pieces=gb)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(sock_path)
        socket.send_fds(c, [b"put" + json.dumps(out).encode()], fds)
        assert c.recv(2) == b"ok"
    print("WRITER", json.dumps(out), flush=True)
    time.sleep(3600)  # until the parent SIGKILLs this process: the memory must outlive it
    return 0


def reader(sock_path: str, out_path: str) -> int:
    d = _drv()
    t_start = time.perf_counter()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(sock_path)
        c.sendall(b"get")
        msg, fds, _, _ = socket.recv_fds(c, 1 << 16, 64)
    w = json.loads(msg)
    out: dict[str, Any] = {"writer": w}
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    dev = _ctx()
    out["context_s"] = round(time.perf_counter() - t_start, 4)
    piece, gb = int(w["piece"]), int(w["pieces"])
    n = piece * gb
    t0 = time.perf_counter()
    handles = [_ok(d.cuMemImportFromShareableHandle(
        fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import") for fd in fds]
    out["import_s"] = round(time.perf_counter() - t0, 4)
    # what a restore needs is device access only (the DMA engine reads the memory); the host's own mapping is
    # timed apart, and four threads each attaching a quarter of the handles
    for which in ("device", "host"):
        tm: dict[str, float] = {}
        t0 = time.perf_counter()
        v = _map(handles, piece, which, tm)
        out[f"attach_{which}_s"] = round(time.perf_counter() - t0, 4)
        out[f"attach_{which}_detail"] = tm
        _unmap(v, n)
    from concurrent.futures import ThreadPoolExecutor

    def quarter(i: int) -> int:
        _ok(d.cuCtxSetCurrent(_ok(d.cuDevicePrimaryCtxRetain(_ok(d.cuDeviceGet(0), "dev")), "ctx")), "ctx")
        return _map(handles[i::4], piece, "device")

    with ThreadPoolExecutor(4) as ex:
        t0 = time.perf_counter()
        vs = list(ex.map(quarter, range(4)))
        out["attach_device_4threads_s"] = round(time.perf_counter() - t0, 4)
    for i, v in enumerate(vs):
        _unmap(v, piece * len(handles[i::4]))
    t0 = time.perf_counter()
    va = _map(handles, piece)
    out["map_access_s"] = round(time.perf_counter() - t0, 4)
    out["attach_gbps"] = round(n / (out["import_s"] + out["map_access_s"]) / 1e9, 1)
    del dev
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream

    def h2d_from(src: int, label: str, rounds: int = 3) -> None:
        rates = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for off in range(0, n, piece):
                _ok(d.cuMemcpyAsync(dst.data_ptr() + off, src + off, piece, stream), "cuMemcpyAsync")
            torch.cuda.synchronize()
            rates.append(n / (time.perf_counter() - t0) / 1e9)
        out[label] = [round(r, 2) for r in rates]

    h2d_from(va, "h2d_from_vmm_gbps")
    with np.errstate(over="ignore"):
        got = int(dst.view(torch.int64).sum().item()) & ((1 << 64) - 1)
    out["bytes_equal_sum"] = got == w["sum"]
    hdr = dst.view(torch.int64)[:: (64 << 20) // 8].cpu().numpy().view(np.uint64)
    out["headers_equal"] = bool(np.all(hdr == (np.arange(len(hdr), dtype=np.uint64) * np.uint64(64 << 20))
                                       ^ np.uint64(0x5DEECE66D)))
    # the same copy from ordinary pinned memory (cuMemHostAlloc): the baseline a ring-based restore DMAs from
    pinned = int(_ok(d.cuMemHostAlloc(piece, 0), "cuMemHostAlloc"))
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for off in range(0, n, piece):
            _ok(d.cuMemcpyAsync(dst.data_ptr() + off, pinned, piece, stream), "cuMemcpyAsync")
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0) / 1e9)
    out["h2d_from_pinned_gbps"] = [round(r, 2) for r in rates]
    _ok(d.cuMemFreeHost(pinned), "cuMemFreeHost")
    # a kernel reading the imported memory in place (zero copy over PCIe)
    try:
        import cupy as cp

        mem = cp.cuda.UnownedMemory(va, n, None)
        arr = cp.ndarray((n // 8,), dtype=cp.uint64, memptr=cp.cuda.MemoryPointer(mem, 0))
        rates = []
        for _ in range(3):
            cp.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            s = int(arr.sum())
            cp.cuda.runtime.deviceSynchronize()
            rates.append(n / (time.perf_counter() - t0) / 1e9)
        out["kernel_read_in_place_gbps"] = [round(r, 2) for r in rates]
        out["kernel_read_sum_equal"] = s == w["sum"]
    except Exception as e:  # noqa: BLE001 - a probe: record what failed, keep the rest
        out["kernel_read_error"] = repr(e)[:300]
    # a CPU read of the imported memory (what a host-side CRC would see)
    t0 = time.perf_counter()
    with np.errstate(over="ignore"):
        cpu_sum = int(np.sum(_view(va, n).view(np.uint64), dtype=np.uint64))
    out["cpu_read_gbps"] = round(n / (time.perf_counter() - t0) / 1e9, 2)
    out["cpu_sum_equal"] = cpu_sum == w["sum"]
    t0 = time.perf_counter()
    _unmap(va, n)
    for h in handles:
        _ok(d.cuMemRelease(h), "cuMemRelease")
    out["unmap_release_s"] = round(time.perf_counter() - t0, 4)
    Path(out_path).write_text(json.dumps(out))
    print("READER", json.dumps(out), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=int, default=8, help="GiB of log memory (1 GiB handles)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keeper", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--writer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reader", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.keeper:
        return keeper(a.keeper)
    if a.writer:
        return writer(a.writer, a.gb)
    if a.reader:
        return reader(*a.reader)
    me = [sys.executable, __file__]
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "keeper.sock")
        res = os.path.join(tmp, "reader.json")
        kp = subprocess.Popen(me + ["--keeper", sock])
        while not os.path.exists(sock):
            time.sleep(0.01)
        wp = subprocess.Popen(me + ["--writer", sock, "--gb", str(a.gb)], stdout=subprocess.PIPE, text=True)
        line = ""
        assert wp.stdout is not None
        for line in wp.stdout:
            if line.startswith("WRITER"):
                break
        if not line.startswith("WRITER"):
            print("writer failed:", wp.wait(), file=sys.stderr)
            kp.kill()
            return 1
        os.kill(wp.pid, signal.SIGKILL)  # the writer dies the way a crashed server does
        wp.wait()
        t0 = time.perf_counter()
        rc = subprocess.call(me + ["--reader", sock, res])
        wall = time.perf_counter() - t0
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(sock)
            c.sendall(b"quit")
        kp.wait()
        if rc != 0:
            print("reader failed:", rc, file=sys.stderr)
            return 1
        out = json.loads(Path(res).read_text())
        out["reader_wall_s"] = round(wall, 3)
        out["writer_sigkilled"] = wp.returncode == -signal.SIGKILL
    print(json.dumps(out, indent=1))
    if a.out:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
        from benchreport import write_results

        print("wrote", write_results("host_vmm", [out], baseline=[], notes=__doc__.split("\n\n")[0],
                                     out_dir=a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
