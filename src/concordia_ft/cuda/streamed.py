"""The CUDA sink of a streamed restore (core/streamed.py): a ring of page-locked host slots, DMA'd to the GPU.

Each slot's bytes go to the device on ONE side stream: a chunk whose pages are one run is DMA'd straight into
place; any other chunk is DMA'd into the slot's device staging twin, and one ``index_copy_`` (8-byte lanes,
a page per row) scatters its pages to where they belong. An event per slot tells when its host memory may be
refilled; the device twin is reused in stream order. The ring (``slots * slot_bytes`` of pinned and of device
memory, 256 MiB each by default) is all the memory a restore adds, whatever the region's size.

``verify="device"``: the checksums the plan carries (the log's deferred record checksums) run on the GPU
(cuda/crc.py): after each chunk's DMA the tile kernel checksums the copied pieces where they landed (in
place, or in the staging twin before the scatter), in stream order; ``finish`` folds each piece's tiles and
reads the piece CRCs back (``collect_crcs``), which core/streamed.py combines per record and compares with the
stored checksums before the restore returns. The host copy threads then only memcpy.

``prepare_ring``: the pinned ring allocated on a helper thread (page-locking 256 MiB takes ~0.1 s), started
before the log's open; the sink built afterwards takes it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.streamed import Chunk, StreamedPlan
from ..errors import ConfigError


def streamable(tensor: Any, nbytes: int, page_bytes: int) -> bool:
    """Whether a region can be streamed into ``tensor`` (whole pages of 8-byte lanes, an aligned buffer)."""
    return (page_bytes % 8 == 0 and nbytes % page_bytes == 0 and int(tensor.data_ptr()) % 8 == 0
            and tensor.numel() * tensor.element_size() >= nbytes)


_prepared: dict[tuple[int, int], Future[Any]] = {}
_prepared_lock = threading.Lock()


def prepare_ring(slots: int, slot_bytes: int, device: int | None = None) -> None:
    """Allocate a ``slots x slot_bytes`` pinned ring on a helper thread; the next ``CudaSink`` of that shape
    takes it (one prepared ring per shape; an unused one is dropped by ``drop_prepared``). ``device``: also
    load the device-checksum kernels there."""
    key = (int(slots), int(slot_bytes))
    with _prepared_lock:
        if key in _prepared:
            return
        fut: Future[Any] = Future()
        _prepared[key] = fut

    def run() -> None:
        import torch

        try:
            fut.set_result(torch.empty(key, dtype=torch.uint8, pin_memory=True))
        except BaseException as e:  # noqa: BLE001 - handed to the sink, which allocates its own
            fut.set_exception(e)
        if device is not None:
            try:  # the CRC kernels loaded (compiled once per machine, then from the cache) off the critical path
                from . import crc

                crc.device_crc(device)
            except Exception:  # noqa: BLE001, S110 - the sink loads them itself and reports what fails
                pass

    threading.Thread(target=run, name="concordia-ring", daemon=True).start()


def _take_prepared(slots: int, slot_bytes: int) -> Any:
    with _prepared_lock:
        fut = _prepared.pop((slots, slot_bytes), None)
    if fut is None:
        return None
    try:
        return fut.result()
    except Exception:  # noqa: BLE001 - allocate again on this thread (its error, if any, is the one raised)
        return None


def drop_prepared() -> None:
    with _prepared_lock:
        futs = list(_prepared.values())
        _prepared.clear()
    for f in futs:
        f.cancel()


class CudaSink:
    def __init__(self, tensor: Any, nbytes: int, page_bytes: int, *, slots: int = 16,
                 slot_bytes: int = 16 << 20, verify: str = "host") -> None:
        import torch

        if verify not in ("host", "device"):
            raise ConfigError(f"verify={verify!r}: use 'host' or 'device'")
        if not streamable(tensor, nbytes, page_bytes):
            raise ConfigError(f"a {nbytes}-byte region of {page_bytes}-byte pages cannot be streamed into this "
                              "tensor (pages must be whole and a multiple of 8 bytes)")
        self.slots, self.page_bytes = int(slots), int(page_bytes)
        self.slot_bytes = max(self.page_bytes, int(slot_bytes) // self.page_bytes * self.page_bytes)
        self.device = tensor.device
        self.flat = tensor.reshape(-1).view(torch.uint8)[:nbytes]
        lanes = self.page_bytes // 8
        self.pages = self.flat.view(torch.int64).view(nbytes // self.page_bytes, lanes)
        per = self.slot_bytes // self.page_bytes
        self.stream: Any = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self.prepared = False
        ring = _take_prepared(self.slots, int(slot_bytes))  # prepared for the requested size (>= the used one)
        if ring is None:
            self.host = torch.empty((self.slots, self.slot_bytes), dtype=torch.uint8, pin_memory=True)
        else:
            self.host = ring[:, :self.slot_bytes]  # rows stay contiguous: each slot is one DMA source
            self.prepared = True
        self.host_np: npt.NDArray[np.uint8] = self.host.numpy()
        self.index = torch.empty((self.slots, per), dtype=torch.int64, pin_memory=True)
        self.index_np: npt.NDArray[np.int64] = self.index.numpy()
        self.dev = torch.empty((self.slots, self.slot_bytes), dtype=torch.uint8, device=self.device)
        self.dev_index = torch.empty((self.slots, per), dtype=torch.int64, device=self.device)
        self.events: list[Any] = [torch.cuda.Event() for _ in range(self.slots)]  # type: ignore[no-untyped-call]
        self.used = [False] * self.slots
        self._torch = torch
        # device verification (set up in begin when the plan carries checks)
        self.verifies = verify == "device"
        self._crc: Any = None
        self._drv_stream: Any = None
        self._piece_dev: list[int] = []  # pid -> device pointer of where its bytes landed (0: not on the device)
        self.crc_stats = {"tiles": 0, "launches": 0}

    def begin(self, plan: StreamedPlan) -> None:
        torch = self._torch
        # the side stream runs after whatever the caller queued on the tensor (its allocation, a memset)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if plan.unfilled:
            with torch.cuda.stream(self.stream):
                self.flat.zero_()
        self.verifies = self.verifies and bool(plan.pieces)
        if self.verifies:
            self._begin_verify(plan)

    def _begin_verify(self, plan: StreamedPlan) -> None:
        from . import crc, driver

        torch = self._torch
        self._crc = crc.device_crc(self.device.index)
        self._drv_stream = driver.Stream.borrow(self.stream.cuda_stream, self.device.index)
        n = len(plan.pieces)
        ntiles = np.array([crc.tiles_of(ln) for _, _, ln in plan.pieces], dtype=np.int64)
        for pid, _ in plan.crc_only:  # checked on the host: no tiles
            ntiles[pid] = 0
        tile0 = np.zeros(n, dtype=np.int64)
        if n > 1:
            tile0[1:] = np.cumsum(ntiles)[:-1]
        self._ntiles, self._tile0 = ntiles, tile0
        self._piece_len = [ln for _, _, ln in plan.pieces]
        total = int(ntiles.sum())
        dev = self.device
        self.tile_crc = torch.zeros(max(1, total), dtype=torch.int32, device=dev)
        self.dev_tile0 = torch.from_numpy(tile0).to(dev)
        self.dev_ntiles = torch.from_numpy(ntiles.astype(np.int32)).to(dev)
        self.dev_out = torch.zeros(max(1, n), dtype=torch.int32, device=dev)
        per = self.slot_bytes // self.page_bytes  # a chunk holds at most one copy per page
        self.meta = torch.zeros((self.slots, per * crc.PIECE_DTYPE.itemsize), dtype=torch.uint8, pin_memory=True)
        self.meta_np = self.meta.numpy().view(crc.PIECE_DTYPE)
        self.dev_meta = torch.zeros((self.slots, per * crc.PIECE_DTYPE.itemsize), dtype=torch.uint8, device=dev)
        self._piece_dev = [0] * n

    def slot(self, i: int) -> npt.NDArray[np.uint8]:
        row: npt.NDArray[np.uint8] = self.host_np[i]
        return row

    def put(self, i: int, chunk: Chunk) -> None:
        torch = self._torch
        n, pb = chunk.nbytes, self.page_bytes
        with torch.cuda.stream(self.stream):
            if chunk.run_start >= 0:
                start = chunk.run_start * pb
                self.flat[start:start + n].copy_(self.host[i, :n], non_blocking=True)
                if self.verifies:
                    self._verify_put(i, chunk)
            else:
                k = n // pb
                self.index_np[i, :k] = chunk.pages
                self.dev[i, :n].copy_(self.host[i, :n], non_blocking=True)
                self.dev_index[i, :k].copy_(self.index[i, :k], non_blocking=True)
                if self.verifies:
                    self._verify_put(i, chunk)  # the staging twin, before the scatter reads it
                src = self.dev[i, :n].view(torch.int64).view(k, pb // 8)
                self.pages.index_copy_(0, self.dev_index[i, :k], src)
            self.events[i].record(self.stream)
        self.used[i] = True

    def _verify_put(self, i: int, chunk: Chunk) -> None:
        """The tile kernel over the chunk's checked pieces, where they are on the device now (in place, or in
        the slot's staging twin before its scatter)."""
        base = (int(self.flat.data_ptr()) + chunk.run_start * self.page_bytes if chunk.run_start >= 0
                else int(self.dev[i].data_ptr()))
        meta = self.meta_np[i]
        k = blocks = 0
        for src, off, pid in chunk.copies:
            if pid < 0:
                continue
            nt = int(self._ntiles[pid])
            ptr = base + off
            self._piece_dev[pid] = ptr
            if nt == 0:
                continue
            meta[k] = (ptr, src.nbytes, int(self._tile0[pid]), blocks)
            k += 1
            blocks += nt
        if not blocks:
            return
        nb = k * meta.itemsize
        self.dev_meta[i, :nb].copy_(self.meta[i, :nb], non_blocking=True)
        self._crc.tiles(int(self.dev_meta[i].data_ptr()), k, blocks, int(self.tile_crc.data_ptr()), self._drv_stream)
        self.crc_stats["tiles"] += blocks
        self.crc_stats["launches"] += 1

    def collect_crcs(self, crcs: list[int]) -> int:
        """After ``finish``: the CRC32C of every checked piece the device received, into ``crcs[pid]``;
        returns how many."""
        if not self.verifies:
            return 0
        from ..core.checksums import crc32c_shift
        from . import crc

        n = len(self._piece_len)
        self._crc.pieces(int(self.dev_tile0.data_ptr()), int(self.dev_ntiles.data_ptr()), n,
                         int(self.tile_crc.data_ptr()), int(self.dev_out.data_ptr()), self._drv_stream)
        self.stream.synchronize()  # the fold ran on the sink's stream, after finish() handed it over
        raw = self.dev_out[:n].cpu().numpy().view(np.uint32)
        shifts: dict[int, int] = {}
        got = 0
        for pid in range(n):
            if not self._piece_dev[pid]:
                continue
            ln = self._piece_len[pid]
            op = shifts.get(ln)
            if op is None:
                op = shifts[ln] = crc32c_shift(ln)
            crcs[pid] = crc.raw_to_crc32c(int(raw[pid]), ln, op)
            got += 1
        return got

    def done(self, i: int) -> bool:
        return not self.used[i] or bool(self.events[i].query())

    def wait(self, i: int) -> None:
        if self.used[i]:
            self.events[i].synchronize()

    def finish(self) -> None:
        self.stream.synchronize()
        # later work on the caller's stream sees the restored bytes
        self._torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        self.host = self.index = self.dev = self.dev_index = None  # type: ignore[assignment]
        self.meta = self.dev_meta = self.tile_crc = self.dev_out = None
