"""Host and device buffers: pinned (page-locked) host memory, host-mapped pinned memory, device memory.

``PinnedBuffer`` comes from ``cuMemHostAlloc(PORTABLE | DEVICEMAP)``: it is page-locked (fast DMA) and mapped
into the device's address space; with unified addressing the device pointer equals the host pointer, so a
kernel can write payloads straight into it (zero-copy). ``view()`` exposes it as a memoryview without a copy.

``DeviceBuffer`` is a plain ``cuMemAlloc`` allocation (not torch's caching allocator: these live as long as
the tracker that owns them). Freeing device memory waits for a resident kernel to exit (see DESIGN.md §3):
trackers allocate up front and free only on close().
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

from . import driver


class PinnedBuffer:
    """Page-locked host memory, mapped into the device address space (``device_ptr``)."""

    def __init__(self, nbytes: int, *, mapped: bool = True) -> None:
        driver.ensure_context()
        drv = driver.bindings()
        flags = drv.CU_MEMHOSTALLOC_PORTABLE | (drv.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
        self.nbytes = int(nbytes)
        self.host_ptr = int(driver.check(drv.cuMemHostAlloc(max(1, self.nbytes), flags),
                                         f"cuMemHostAlloc({nbytes} bytes)"))
        self.device_ptr = 0
        if mapped:
            self.device_ptr = int(driver.check(drv.cuMemHostGetDevicePointer(self.host_ptr, 0),
                                               "cuMemHostGetDevicePointer"))
        self._raw = (ctypes.c_char * max(1, self.nbytes)).from_address(self.host_ptr)

    def _live(self) -> Any:
        if not self.host_ptr:
            raise ValueError(f"the {self.nbytes}-byte pinned buffer was closed (its memory is freed)")
        return self._raw

    def view(self, nbytes: int | None = None, offset: int = 0) -> memoryview:
        raw = self._live()
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"view [{offset}, +{n}) is outside the {self.nbytes}-byte pinned buffer")
        return memoryview(raw).cast("B")[offset:offset + n]

    def numpy(self, dtype: npt.DTypeLike = np.uint8, count: int = -1, offset: int = 0) -> npt.NDArray[Any]:
        out: npt.NDArray[Any] = np.frombuffer(memoryview(self._live()).cast("B"), dtype=dtype, count=count,
                                              offset=offset)
        return out

    def close(self) -> None:
        if self.host_ptr:
            driver.check(driver.bindings().cuMemFreeHost(self.host_ptr), "cuMemFreeHost")
            self.host_ptr = 0
            self.device_ptr = 0

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a poisoned context
            pass


class DeviceBuffer:
    """``nbytes`` of device memory from cuMemAlloc, freed on close()."""

    def __init__(self, nbytes: int, *, zero: bool = False) -> None:
        self.device = driver.ensure_context()
        self.nbytes = int(nbytes)
        self.ptr = driver.mem_alloc(self.nbytes)
        if zero:
            driver.check(driver.bindings().cuMemsetD8(self.ptr, 0, max(1, self.nbytes)), "cuMemsetD8")

    def close(self) -> None:
        if self.ptr:
            driver.mem_free(self.ptr)
            self.ptr = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def pinned_host_array(nbytes: int) -> npt.NDArray[np.uint8]:
    """``nbytes`` of page-locked host memory as a writable numpy array (contents undefined).

    Recovery replays GPU regions into this, so the restore is one DMA per region at full PCIe speed instead
    of the driver staging pageable memory through its own bounce buffers. It comes from torch's pinned
    caching allocator, not cuMemHostAlloc: page-locking hundreds of MB costs tens of ms, and the cache hands
    the same memory to the next recovery of that size in this process once the array is gone (the array
    keeps its tensor, hence the memory, alive). Raises RuntimeError when the memory cannot be pinned."""
    t = pinned_tensor(nbytes)
    out: npt.NDArray[np.uint8] = t.numpy()
    return out


def reserve_pinned(nbytes: int) -> None:
    """Page-lock ``nbytes`` now and leave them in torch's pinned cache, so that the first recovery of a region
    up to that size pins nothing (a serving process calls this at startup with its KV capacity, beside
    loading and warming its model). Raises RuntimeError when the memory cannot be pinned."""
    del_me = pinned_tensor(nbytes)
    del del_me


def pinned_tensor(nbytes: int) -> Any:
    """A torch uint8 CPU tensor in pinned memory (torch's pinned allocator; also device-mapped under UVA)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
