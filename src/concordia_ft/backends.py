"""One backend interface: how regions of one kind of memory are tracked, batched and restored.

The runtime picks a backend per region from where its buffer lives (``backend_for``) and from then on asks
the backend, never the buffer's type: the CPU backend (numpy trackers, the reference) for host memory, the
CUDA backend (JIT-compiled handlers, cuda/) for device memory. The CUDA backend imports nothing from
``concordia_ft.cuda`` until a device region is registered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from .buffers import host_bitmap, host_bytes
from .core.images import ImageAlloc
from .core.log import RecoveryLog
from .core.regions import MemoryRange, RegionKind, RegionSpec
from .core.tracking import DenseBatch, Tracker
from .errors import ConcordiaError, ConfigError, RegionError

if TYPE_CHECKING:
    from .cpu.trackers import CpuTracker

log = logging.getLogger("concordia_ft.runtime")

DEVICE_HANDLERS = ("auto", "cuda", "cpu")


class Backend(Protocol):
    name: str

    def make_tracker(self, spec: RegionSpec, buf: Any, dirty_blocks: Any) -> Tracker:
        """A tracker of ``buf`` (registered as ``spec``)."""
        ...

    def batch_dense(self, trackers: Sequence[Tracker]) -> list[DenseBatch]:
        """The dense regions of this backend, staged together by asynchronous epochs."""
        ...

    def attach_log(self, tracker: Tracker, log: RecoveryLog) -> None:
        """``tracker`` will be logged into ``log``: a chance to use what the log offers (placed payloads)."""
        ...

    def image_alloc(self, tracker: Tracker, *, direct: bool, pinned: bool) -> ImageAlloc | None:
        """Where replay writes a region that is restored into ``tracker``'s buffer (None: zeroed numpy memory).
        ``direct``: no image is handed back to the caller, so replay may write into the buffer itself."""
        ...

    def stream_sink(self, tracker: Tracker, *, slots: int, slot_bytes: int, verify: str = "host") -> Any:
        """A sink (core/streamed.py) that restores ``tracker``'s buffer straight from the log's mapped segments,
        or None: restore it from an image. ``verify="device"``: the sink may checksum the copied pieces itself
        (RecoveryOptions.stream_verify)."""
        ...


class CpuBackend:
    name = "cpu"

    def make_tracker(self, spec: RegionSpec, buf: Any, dirty_blocks: Any) -> Tracker:
        from .cpu.trackers import CpuTracker

        try:
            # a paged tracker's bitmap is its state: it needs no full first epoch unless the runtime asks
            return CpuTracker(spec, host_bytes(buf), host_bitmap(dirty_blocks), synced=spec.kind is RegionKind.PAGED)
        except ValueError as e:
            raise RegionError(str(e)) from None

    def batch_dense(self, trackers: Sequence[Tracker]) -> list[DenseBatch]:
        from .cpu.trackers import CpuDenseBatch

        return [CpuDenseBatch(list(trackers))]  # type: ignore[arg-type]

    def attach_log(self, tracker: Tracker, log: RecoveryLog) -> None:
        """Host payloads are copied by the append itself: nothing to place."""

    def image_alloc(self, tracker: Tracker, *, direct: bool, pinned: bool) -> ImageAlloc | None:
        """With ``direct``, a region that is a whole number of pages is replayed into its own buffer, so the
        restore has nothing to copy."""
        spec = tracker.spec
        if not direct or spec.nbytes % spec.page_bytes:
            return None
        target = cast("CpuTracker", tracker).buf  # this backend's trackers
        return lambda nbytes: target if nbytes == target.nbytes else np.empty(nbytes, dtype=np.uint8)

    def stream_sink(self, tracker: Tracker, *, slots: int, slot_bytes: int, verify: str = "host") -> Any:
        """None: host regions are replayed straight into their own buffer (``image_alloc``) already."""
        return None


class CudaBackend:
    name = "cuda"

    def make_tracker(self, spec: RegionSpec, buf: Any, dirty_blocks: Any) -> Tracker:
        from .cuda.trackers import make_cuda_tracker

        return make_cuda_tracker(spec, buf, dirty_blocks=dirty_blocks)

    def batch_dense(self, trackers: Sequence[Tracker]) -> list[DenseBatch]:
        from .cuda.trackers import batch_dense

        return list(batch_dense(list(trackers)))  # type: ignore[arg-type]

    def attach_log(self, tracker: Tracker, log: RecoveryLog) -> None:
        """Into mapped segments (the dram backend), paged and dense regions (and opaque ones in asynchronous
        epochs) hand the log device payloads that it DMAs straight into its own pages (core/mapped.py, cuda/mapped.py); the mappings are pinned with the
        driver once, and each later segment ahead of its use."""
        kind = tracker.spec.kind
        if log.accepts_placed and kind in (RegionKind.PAGED, RegionKind.DENSE, RegionKind.OPAQUE):
            from .cuda.mapped import register_host_range

            log.set_mapping_registrar(register_host_range)
            # a CUDA tracker (this backend's): asynchronous epochs of all three, synchronous ones of paged and
            # dense (an opaque region's synchronous advance reads its staged host payload)
            tracker.placed_async = True  # type: ignore[attr-defined]
            if kind is not RegionKind.OPAQUE:
                tracker.direct = True  # type: ignore[attr-defined]

    def image_alloc(self, tracker: Tracker, *, direct: bool, pinned: bool) -> ImageAlloc | None:
        """Page-locked host memory, so each region goes to the device in one DMA."""
        return pinned_or_pageable if pinned else None

    def stream_sink(self, tracker: Tracker, *, slots: int, slot_bytes: int, verify: str = "host") -> Any:
        """Paged regions (a KV pool: the bulk of a serving engine's state, and no detection state to re-base):
        a ring of pinned slots DMA'd to the device (cuda/streamed.py)."""
        if tracker.spec.kind is not RegionKind.PAGED:
            return None
        from .cuda.streamed import CudaSink, streamable

        t = cast(Any, tracker).tensor
        if not streamable(t, tracker.spec.nbytes, tracker.spec.page_bytes):
            return None
        return CudaSink(t, tracker.spec.nbytes, tracker.spec.page_bytes, slots=slots, slot_bytes=slot_bytes,
                        verify=verify)


def pinned_or_pageable(nbytes: int) -> Any:
    """Page-locked host memory for a GPU region's image; pageable memory (slower DMA) when pinning fails."""
    from .cuda.memory import pinned_host_array

    try:
        return pinned_host_array(nbytes)
    except (RuntimeError, ConcordiaError) as e:
        log.warning("could not pin %d bytes of host memory for recovery (%s); restoring from pageable memory, "
                    "which copies to the GPU several times slower", nbytes, e)
        return np.empty(nbytes, dtype=np.uint8)


CPU = CpuBackend()
CUDA = CudaBackend()


def check_device_handlers(value: str) -> str:
    if value not in DEVICE_HANDLERS:
        raise ConfigError(f"device_handlers must be one of {', '.join(map(repr, DEVICE_HANDLERS))}, got {value!r}")
    return value


def backend_for(name: str, where: MemoryRange, device_handlers: str) -> Backend:
    """The backend of a region whose buffer lives at ``where``."""
    if where.device.startswith("cuda"):
        if device_handlers == "cpu":
            raise ConfigError(f"region {name!r} is on {where.device} but device_handlers='cpu'; register a host "
                              "buffer, or use device_handlers='auto'")
        return CUDA
    return CPU
