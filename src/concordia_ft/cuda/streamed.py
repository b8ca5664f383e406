"""The CUDA sink of a streamed restore (core/streamed.py): a ring of page-locked host slots, DMA'd to the GPU.

Each slot's bytes go to the device on ONE side stream: a chunk whose pages are one run is DMA'd straight into
place; any other chunk is DMA'd into the slot's device staging twin, and one ``index_copy_`` (8-byte lanes,
a page per row) scatters its pages to where they belong. An event per slot tells when its host memory may be
refilled; the device twin is reused in stream order. The ring (``slots * slot_bytes`` of pinned and of device
memory, 256 MiB each by default) is all the memory a restore adds, whatever the region's size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.streamed import Chunk, StreamedPlan
from ..errors import ConfigError


def streamable(tensor: Any, nbytes: int, page_bytes: int) -> bool:
    """Whether a region can be streamed into ``tensor`` (whole pages of 8-byte lanes, an aligned buffer)."""
    return (page_bytes % 8 == 0 and nbytes % page_bytes == 0 and int(tensor.data_ptr()) % 8 == 0
            and tensor.numel() * tensor.element_size() >= nbytes)


class CudaSink:
    def __init__(self, tensor: Any, nbytes: int, page_bytes: int, *, slots: int = 16,
                 slot_bytes: int = 16 << 20) -> None:
        import torch

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
        self.host = torch.empty((self.slots, self.slot_bytes), dtype=torch.uint8, pin_memory=True)
        self.host_np: npt.NDArray[np.uint8] = self.host.numpy()
        self.index = torch.empty((self.slots, per), dtype=torch.int64, pin_memory=True)
        self.index_np: npt.NDArray[np.int64] = self.index.numpy()
        self.dev = torch.empty((self.slots, self.slot_bytes), dtype=torch.uint8, device=self.device)
        self.dev_index = torch.empty((self.slots, per), dtype=torch.int64, device=self.device)
        self.events: list[Any] = [torch.cuda.Event() for _ in range(self.slots)]  # type: ignore[no-untyped-call]
        self.used = [False] * self.slots
        self._torch = torch

    def begin(self, plan: StreamedPlan) -> None:
        torch = self._torch
        # the side stream runs after whatever the caller queued on the tensor (its allocation, a memset)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if plan.unfilled:
            with torch.cuda.stream(self.stream):
                self.flat.zero_()

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
            else:
                k = n // pb
                self.index_np[i, :k] = chunk.pages
                self.dev[i, :n].copy_(self.host[i, :n], non_blocking=True)
                self.dev_index[i, :k].copy_(self.index[i, :k], non_blocking=True)
                src = self.dev[i, :n].view(torch.int64).view(k, pb // 8)
                self.pages.index_copy_(0, self.dev_index[i, :k], src)
            self.events[i].record(self.stream)
        self.used[i] = True

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
