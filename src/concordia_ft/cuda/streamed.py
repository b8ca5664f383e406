"""The CUDA sink of a streamed restore (core/streamed.py): a ring of page-locked host slots, DMA'd to the GPU.

Each slot's bytes go to the device on ONE side stream: a chunk whose pages are one run is DMA'd straight into
place; any other chunk is DMA'd into the slot's device staging twin, and one ``index_copy_`` (8-byte lanes,
a page per row) scatters its pages to where they belong. An event per slot tells when its host memory may be
refilled; the device twin is reused in stream order. The ring (``slots * slot_bytes`` of pinned and of device
memory, 256 MiB each by default) is all the memory a restore adds, whatever the region's size. The transfers,
events and kernel launches are driver calls (cuda-bindings, GIL released), a few microseconds each: the
driving thread handles ~900 chunks for a 15 GB pool while 16 copy threads want the GIL too.

``verify="device"``: the checksums the plan carries (the log's deferred record checksums) run on the GPU
(cuda/crc.py): after each chunk's DMA the tile kernel checksums the copied pieces where they landed (in
place, or in the staging twin before the scatter), in stream order; ``collect_crcs`` (after ``finish``)
folds each piece's tiles and reads the piece CRCs back, which core/streamed.py combines per record and compares
with the stored checksums before the restore returns. The host copy threads then only memcpy.

The side stream is the sink's own (``cuStreamCreate``, non-blocking), not one of torch's pooled streams:
``torch.cuda.Stream()`` hands out one of 32 pooled streams round robin, so a restore's stream could be the very
stream a decode graph is being captured on beside it (serve/engine.py ``warm_graphs``); the restore's DMAs
would then be captured instead of run, and its events refused (``CUDA_ERROR_CAPTURED_EVENT``).

The ring is ``cuMemHostAlloc`` memory (~0.1 s to page-lock 256 MiB on the H200 host), page-locked when the sink
is built, and freed on a helper thread after the last transfer (``close``). (Page-locking it on a helper
thread while the log was opened stretched the open on the H200 host by more than it hid: serve/DESIGN.md,
"Recovery".)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.streamed import Chunk, StreamedPlan
from ..errors import ConfigError
from . import driver


def streamable(tensor: Any, nbytes: int, page_bytes: int) -> bool:
    """Whether a region can be streamed into ``tensor`` (whole pages of 8-byte lanes, an aligned buffer)."""
    return (page_bytes % 8 == 0 and nbytes % page_bytes == 0 and int(tensor.data_ptr()) % 8 == 0
            and tensor.numel() * tensor.element_size() >= nbytes)


def _alloc_ring(slots: int, slot_bytes: int, device: int | None) -> Any:
    from .memory import PinnedBuffer

    driver.ensure_context(device)
    return PinnedBuffer(slots * slot_bytes, mapped=False)


_NOT_READY = 600  # CUDA_ERROR_NOT_READY
DIRECT_LANES = 8  # put_direct's CRC descriptor rows in flight (a row is reused once its upload has run)


class CudaSink:
    def __init__(self, tensor: Any, nbytes: int, page_bytes: int, *, slots: int = 16,
                 slot_bytes: int = 16 << 20, verify: str = "host") -> None:
        import torch

        from .memory import PinnedBuffer

        if verify not in ("host", "device"):
            raise ConfigError(f"verify={verify!r}: use 'host' or 'device'")
        if not streamable(tensor, nbytes, page_bytes):
            raise ConfigError(f"a {nbytes}-byte region of {page_bytes}-byte pages cannot be streamed into this "
                              "tensor (pages must be whole and a multiple of 8 bytes)")
        self.slots, self.page_bytes = int(slots), int(page_bytes)
        self.slot_bytes = max(self.page_bytes, int(slot_bytes) // self.page_bytes * self.page_bytes)
        self.device = tensor.device
        self.dev_no = driver.ensure_context(self.device.index)
        self.flat = tensor.reshape(-1).view(torch.uint8)[:nbytes]
        self.flat_ptr = int(self.flat.data_ptr())
        lanes = self.page_bytes // 8
        self.pages = self.flat.view(torch.int64).view(nbytes // self.page_bytes, lanes)
        per = self.per = self.slot_bytes // self.page_bytes
        # the sink's own stream (never one of torch's pooled streams: see the module docstring)
        self.ds = driver.Stream.create(non_blocking=True, device=self.dev_no)
        self.stream: Any = torch.cuda.ExternalStream(self.ds.handle, device=self.device)  # type: ignore[no-untyped-call]
        # host ring: cuMemHostAlloc memory (page-locked for this restore, freed after it on a helper thread)
        self.raw_slot = self.slot_bytes
        ring_bytes = self.slots * self.raw_slot
        self.ring = _alloc_ring(self.slots, self.raw_slot, self.dev_no)
        self.host_np: npt.NDArray[np.uint8] = self.ring.numpy()[:ring_bytes].reshape(self.slots, self.raw_slot)
        self.host_ptr = int(self.ring.host_ptr)
        self.small = PinnedBuffer(self.slots * per * 8, mapped=False)  # the scatter's page indices
        self.index_np: npt.NDArray[np.int64] = self.small.numpy(np.int64).reshape(self.slots, per)
        self.dev = torch.empty((self.slots, self.slot_bytes), dtype=torch.uint8, device=self.device)
        self.dev_index = torch.empty((self.slots, per), dtype=torch.int64, device=self.device)
        drv = driver.bindings()
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.events = [driver.check(drv.cuEventCreate(flags), "cuEventCreate") for _ in range(self.slots)]
        self.used = [False] * self.slots
        self._torch = torch
        # device verification (set up in begin when the plan carries checks)
        self.verifies = verify == "device"
        self._crc: Any = None
        self._piece_dev: list[int] = []  # pid -> device pointer of where its bytes landed (0: not on the device)
        self.crc_stats = {"tiles": 0, "launches": 0}
        self._lane = 0  # the next direct lane (a meta row + event of its own, after the slots')
        self._lane_used = [False] * DIRECT_LANES
        self._lane_events = [driver.check(drv.cuEventCreate(flags), "cuEventCreate") for _ in range(DIRECT_LANES)]

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
        from . import crc
        from .memory import PinnedBuffer

        torch = self._torch
        self._crc = crc.device_crc(self.dev_no)
        n = len(plan.pieces)
        ntiles = np.array([crc.tiles_of(ln) for _, _, ln in plan.pieces], dtype=np.int64)
        for pid, _ in plan.crc_only:  # checked on the host: no tiles
            ntiles[pid] = 0
        tile0 = np.zeros(n, dtype=np.int64)
        if n > 1:
            tile0[1:] = np.cumsum(ntiles)[:-1]
        self._ntiles, self._tile0 = ntiles.tolist(), tile0.tolist()
        self._piece_len = [ln for _, _, ln in plan.pieces]
        total = int(ntiles.sum())
        dev = self.device
        self.tile_crc = torch.zeros(max(1, total), dtype=torch.int32, device=dev)
        self.dev_tile0 = torch.from_numpy(tile0).to(dev)
        self.dev_ntiles = torch.from_numpy(ntiles.astype(np.int32)).to(dev)
        self.dev_out = torch.zeros(max(1, n), dtype=torch.int32, device=dev)
        item = crc.PIECE_DTYPE.itemsize
        rows = self.slots + DIRECT_LANES  # a row per slot, then the direct lanes' (put_direct)
        self.meta = PinnedBuffer(rows * self.per * item, mapped=False)  # a chunk: at most a copy per page
        self.meta_np = self.meta.numpy().view(crc.PIECE_DTYPE).reshape(rows, self.per)
        self.dev_meta = torch.zeros((rows, self.per * item), dtype=torch.uint8, device=dev)
        tc = int(self.tile_crc.data_ptr())
        self._args = [self._crc.tile_args(int(self.dev_meta[i].data_ptr()), tc) for i in range(rows)]
        self._piece_dev = [0] * n

    def slot(self, i: int) -> npt.NDArray[np.uint8]:
        row: npt.NDArray[np.uint8] = self.host_np[i]
        return row

    def put(self, i: int, chunk: Chunk) -> None:
        n, pb = chunk.nbytes, self.page_bytes
        src = self.host_ptr + i * self.raw_slot
        if chunk.run_start >= 0:
            dst = self.flat_ptr + chunk.run_start * pb
            driver.memcpy_htod_async(dst, src, n, self.ds)
            if self.verifies:
                self._verify_put(i, chunk, dst)
        else:
            k = n // pb
            self.index_np[i, :k] = chunk.pages
            staging = int(self.dev[i].data_ptr())
            driver.memcpy_htod_async(staging, src, n, self.ds)
            driver.memcpy_htod_async(int(self.dev_index[i].data_ptr()), int(self.small.host_ptr) + i * self.per * 8,
                                     k * 8, self.ds)
            if self.verifies:
                self._verify_put(i, chunk, staging)  # the staging twin, before the scatter reads it
            torch = self._torch
            with torch.cuda.stream(self.stream):
                src_rows = self.dev[i, :n].view(torch.int64).view(k, pb // 8)
                self.pages.index_copy_(0, self.dev_index[i, :k], src_rows)
        driver.check(driver.bindings().cuEventRecord(self.events[i], self.ds.handle), "cuEventRecord")
        self.used[i] = True

    def put_direct(self, chunk: Chunk, translate: Callable[[int, int], int | None]) -> None:
        """A one-run chunk DMA'd straight into place (no slot) from where ``translate(address, nbytes)`` says the
        device reads its source bytes (a pinned log mirror, cuda/mirror.py; mapped for the device only, so the
        copy is the driver's unified one), then its pieces checksummed where they landed, as ``put`` does."""
        dst = self.flat_ptr + chunk.run_start * self.page_bytes
        drv = driver.bindings()
        for src, off, _ in chunk.copies:
            if src.nbytes:
                a = int(np.frombuffer(src, dtype=np.uint8).ctypes.data)
                at = translate(a, src.nbytes)
                assert at is not None  # run_streamed sends only chunks whose every range translates
                driver.check(drv.cuMemcpyAsync(dst + off, at, src.nbytes, self.ds.handle),
                             "cuMemcpyAsync (pinned log mirror -> pool)")
        if self.verifies:
            j = self._lane
            self._lane = (j + 1) % DIRECT_LANES
            if self._lane_used[j]:  # its meta row's last upload must have left the host
                driver.check(driver.bindings().cuEventSynchronize(self._lane_events[j]), "cuEventSynchronize")
            self._verify_put(self.slots + j, chunk, dst)
            driver.check(driver.bindings().cuEventRecord(self._lane_events[j], self.ds.handle), "cuEventRecord")
            self._lane_used[j] = True

    def _verify_put(self, i: int, chunk: Chunk, base: int) -> None:
        """The tile kernel over the chunk's checked pieces, where they are on the device now (``base``: where
        the chunk's first byte landed)."""
        meta = self.meta_np[i]
        k = blocks = 0
        for src, off, pid in chunk.copies:
            if pid < 0:
                continue
            nt = self._ntiles[pid]
            ptr = base + off
            self._piece_dev[pid] = ptr
            if nt == 0:
                continue
            meta[k] = (ptr, src.nbytes, self._tile0[pid], blocks)
            k += 1
            blocks += nt
        if not blocks:
            return
        nb = k * meta.itemsize
        driver.memcpy_htod_async(int(self.dev_meta[i].data_ptr()), int(self.meta.host_ptr) + i * self.per * meta.itemsize,
                                 nb, self.ds)
        self._crc.launch_tiles(self._args[i], k, blocks, self.ds)
        self.crc_stats["tiles"] += blocks
        self.crc_stats["launches"] += 1

    def collect_crcs(self, crcs: list[int]) -> int:
        """After ``finish``: the CRC32C of every checked piece the device received, into ``crcs[pid]``;
        returns how many."""
        if not self.verifies:
            return 0
        from ..core.checksums import crc32c_shift, raw_to_crc32c

        n = len(self._piece_len)
        self._crc.pieces(int(self.dev_tile0.data_ptr()), int(self.dev_ntiles.data_ptr()), n,
                         int(self.tile_crc.data_ptr()), int(self.dev_out.data_ptr()), self.ds)
        self.ds.synchronize()  # the fold ran on the sink's stream, after finish() handed it over
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
            crcs[pid] = raw_to_crc32c(int(raw[pid]), ln, op)
            got += 1
        return got

    def done(self, i: int) -> bool:
        if not self.used[i]:
            return True
        (err,) = driver.bindings().cuEventQuery(self.events[i])
        if int(err) == _NOT_READY:
            return False
        driver.check((err,), "cuEventQuery")
        return True

    def wait(self, i: int) -> None:
        if self.used[i]:
            driver.check(driver.bindings().cuEventSynchronize(self.events[i]), "cuEventSynchronize")

    def finish(self) -> None:
        self.ds.synchronize()
        # later work on the caller's stream sees the restored bytes
        self._torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        """Release the ring (the pinned memory on a helper thread: unpinning 256 MiB is not free) after
        whatever was queued on the side stream ran."""
        if self.ring is None:
            return
        try:
            self.ds.synchronize()
        finally:
            bufs = [b for b in (self.ring, self.small, getattr(self, "meta", None)) if b is not None]
            self.ring = self.small = self.meta = None  # type: ignore[assignment]
            self.dev = self.dev_index = self.dev_meta = self.tile_crc = self.dev_out = None  # type: ignore[assignment]
            self.ds.close()  # after the synchronize: nothing is queued on it
            drv = driver.bindings()
            for ev in self.events + self._lane_events:
                drv.cuEventDestroy(ev)
            self.events, self._lane_events = [], []
            dev_no = self.dev_no

            def free() -> None:
                driver.ensure_context(dev_no)
                for b in bufs:
                    b.close()

            threading.Thread(target=free, name="concordia-ring-free", daemon=True).start()
