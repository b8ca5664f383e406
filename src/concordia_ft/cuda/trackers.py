"""CUDA trackers: ``make_cuda_tracker(spec, tensor)`` implements core.tracking's Tracker for a CUDA tensor.

One epoch (see core/tracking.py): ``collect`` finds the dirty pages ON THE GPU and stages them into ONE pinned
host buffer (the delta's ``payload`` is a memoryview of it, valid until the next ``collect`` of this tracker);
``advance`` runs after the commit and moves shadows / hashes / dirty flags forward from exactly the committed
bytes; ``restore`` writes pages back into the tensor: a whole region (what recovery restores) as ONE
host-to-device copy followed by the shadow / hash re-base on the device, a subset by a scatter kernel.

Per kind:
- opaque, ``diff=hash`` (the default we recommend, see DESIGN.md): ``concordia_scan_hash`` over the whole
  region (1x bytes read) against 8 B of state per page; advance hashes the committed payload pages.
- opaque, ``diff=shadow``: ``concordia_scan_shadow`` against a device copy (2x bytes read, 100% memory);
  advance scatters the committed payload pages into the shadow.
- paged: the owner's ``dirty_blocks`` (uint8/bool, one per KV block) -> page list; advance clears the flags
  of the committed blocks.
- dense: every page, every epoch (one DtoH). immutable: every page once, then nothing.

Staging (``staging=``): ``"mapped"`` (default) - the gather kernel writes the payload straight into the
host-mapped pinned buffer: scan + gather + ONE stream sync, no memcpy; ``"device"`` - gather into device
memory, sync to learn the count, one DtoH of exactly the dirty bytes, sync. bench_delta_gpu.py measures both.
Work runs on torch's current stream of the tensor's device (ordered after the application's writes) unless
a ``stream`` is given.

Asynchronous epochs (``stage``, core/tracking.py): on the caller's stream, with no host synchronisation, the
epoch's pages are copied into a DEVICE snapshot buffer (the region's padded size, allocated at the tracker's
first ``stage``): dense and full epochs one D2D copy of the region, opaque the scan then a gather of the dirty
pages (count read on the device), paged the flags copied to a device snapshot and cleared, then scan + gather;
then an event. The background writer waits for the event, copies the snapshot DtoH into the pinned staging
buffer on the tracker's own non-blocking stream, and after the commit advances shadows / hashes from the
snapshot on that stream. Immutable regions take no snapshot (their contract is that they never change): their
one full epoch is copied straight from the region after the event.

Dense regions are staged by a ``CudaDenseBatch`` per device instead (``batch_dense``; core/tracking.py): one
device snapshot holding every member, the D2D copies planned once (``plan_dense_copies``: regions adjacent in
memory share one copy, e.g. LoRA's adapter and moments in one arena), ONE event; the writer copies each member
DtoH into that member's own pinned staging buffer (the one its sync ``collect`` uses).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from ..core.regions import DiffMode, RegionKind, RegionSpec
from ..core.tracking import RegionDelta, pages_to_runs, plan_dense_copies
from ..errors import ConfigError, RegionError
from . import driver
from .handlers import HandlerModule, reference_page_hash
from .memory import DeviceBuffer, PinnedBuffer

_modules: dict[tuple[Any, int], HandlerModule] = {}
_modules_lock = threading.Lock()  # held while a module loads: one load per (geometry, device), ever
_LIST_OFFSET = 64  # the mapped list buffer: count word at 0, int64 page list from byte 64

# what an asynchronous stage left for the background writer
_ALL = "all"  # the whole region, in the device snapshot (tail page zero-padded)
_LISTED = "listed"  # count + page list in the mapped list buffer, those pages in the device snapshot
_LIVE = "live"  # the whole region, read from the region itself (immutable: it never changes)
_NONE = "none"  # nothing (immutable after its first epoch)


def handler_module(spec: RegionSpec, device: int) -> HandlerModule:
    """One loaded module per (geometry, device), shared by trackers (module loads are hazards: do few)."""
    from .handlers import Geometry

    key = (Geometry.of(spec), device)
    m = _modules.get(key)
    if m is not None:
        return m
    with _modules_lock:  # trackers made in several threads at once load each module once
        m = _modules.get(key)
        if m is None:
            m = _modules[key] = HandlerModule(spec, device)
        return m


# below this a payload is staged as before (DtoH into pinned memory, then the append's memcpy): the placed path's
# extra planning pass costs more than the copy it saves (H200: one 4 KiB page 0.38 ms placed vs 0.26 ms staged)
DIRECT_MIN_BYTES = 256 << 10


class CudaTracker:
    """Shared machinery; the kind-specific parts are ``_collect_sparse`` and ``_advance_sparse``."""

    def __init__(self, spec: RegionSpec, tensor: Any, *, stream: driver.Stream | None = None,
                 staging: str = "mapped", profile: bool = False) -> None:
        if staging not in ("mapped", "device"):
            raise ConfigError(f"staging={staging!r}; use 'mapped' or 'device'")
        if not getattr(tensor, "is_cuda", False):
            raise RegionError(f"region {spec.name!r}: make_cuda_tracker needs a CUDA tensor, got {type(tensor)}")
        if not tensor.is_contiguous():
            raise RegionError(f"region {spec.name!r}: the tensor is not contiguous; register a contiguous tensor")
        have = tensor.numel() * tensor.element_size()
        if have < spec.nbytes:
            raise RegionError(f"region {spec.name!r}: spec says {spec.nbytes} bytes, the tensor has {have}")
        self.base = int(tensor.data_ptr())
        if self.base % 16:
            raise RegionError(f"region {spec.name!r}: data pointer {self.base:#x} is not 16-byte aligned; "
                              "register a tensor that starts on a 16-byte boundary")
        self.spec = spec
        self.tensor = tensor
        self.device = driver.ensure_context(int(tensor.device.index or 0))
        self._stream = stream
        self.staging = staging
        self.profile = profile
        self.mod = handler_module(spec, self.device)
        self.page_bytes = spec.page_bytes
        self.n_pages = spec.n_pages
        self.padded_bytes = self.n_pages * self.page_bytes
        self.initialised = False  # state (shadow / hashes / flags) reflects a committed epoch
        self._payload: PinnedBuffer | None = None  # ONE pinned staging buffer, all epochs
        self._list = PinnedBuffer(_LIST_OFFSET + 8 * self.n_pages)  # mapped: count + page list
        self._list_np = self._list.numpy(np.int64, count=self.n_pages, offset=_LIST_OFFSET)
        self._count_np = self._list.numpy(np.uint32, count=1)
        self._dev_stage: DeviceBuffer | None = None
        self._needs_sync = False
        self._last_delta: RegionDelta | None = None  # the delta collect() handed out last
        self._list_holds: Any = None  # the pages array whose values the mapped list buffer holds
        self._staging_view: memoryview | None = None
        self._gather_args: driver.KernelArgs | None = None
        self._adv_args: driver.KernelArgs | None = None
        self.last_collect_device_ms = float("nan")
        self._events: list[driver.Event] = []
        self._snap: DeviceBuffer | None = None  # asynchronous epochs: the device snapshot
        self._flag_snap: DeviceBuffer | None = None  # paged, asynchronous: the flags taken by the last stage
        self._side_stream: driver.Stream | None = None  # asynchronous epochs: DtoH + advance
        self._ready: driver.Event | None = None  # recorded on the caller's stream after the snapshot
        self._stage_gather_args: driver.KernelArgs | None = None
        self._gate: PinnedBuffer | None = None
        self._gate_seq = 0
        # direct: the log's segments are mapped and registered (core/mapped.py): synchronous collects hand the
        # log a DevicePayload (device bytes it DMAs into its own pages) instead of staging into pinned memory.
        # Set by the Runtime for paged and dense regions (an opaque region's advance reads its staged payload).
        self.direct = False
        # placed_async: the same for asynchronous epochs (Runtime.checkpoint_async): the background writer hands
        # the log the device snapshot as a DevicePayload (DMA'd into the log's pages on the side stream) instead
        # of a DtoH into pinned staging that the append then copies again. Paged, dense and opaque regions (an
        # opaque region's staged advance reads its device snapshot, never the payload).
        self.placed_async = False
        if profile:
            # profile mode times the GPU work alone: the stream waits on a host flag while the host enqueues
            # the kernels between two events, then the flag is released (no host launch gaps in the time)
            self._events = [driver.Event() for _ in range(4)]
            self._gate = PinnedBuffer(64)
            self._gate_np = self._gate.numpy(np.uint32, count=1)
            self._gate_np[0] = 0

    # ---- plumbing ----
    @property
    def stream(self) -> driver.Stream:
        if self._stream is not None:
            return self._stream
        return driver.Stream.from_torch(self.device)

    def _staging(self, need: int | None = None) -> PinnedBuffer:
        """The ONE pinned staging buffer. "mapped" staging gathers into it before the dirty count is known,
        so it spans the region; "device" staging learns the count first, so its buffer starts at 64 pages
        and doubles as needed (pinning a whole KV arena can cost 10s of ms, e.g. right after a recovery)."""
        if self.staging == "mapped":
            need = self.padded_bytes
        else:
            need = max(need or 0, min(self.padded_bytes, 64 * self.page_bytes))
        if self._payload is None or self._payload.nbytes < need:
            size = need if self._payload is None else min(self.padded_bytes, max(need, 2 * self._payload.nbytes))
            if self._payload is not None:
                self._staging_view = None
                self._gather_args = None
                self._payload.close()  # the delta that used it was committed and advanced before this collect
            self._payload = PinnedBuffer(size)
            self._staging_view = self._payload.view()
        return self._payload

    def _gate_hold(self, stream: driver.Stream) -> None:
        """Profile mode: hold the stream until _gate_release, then record the start event."""
        if self._gate is None:
            return
        self._gate_seq = (self._gate_seq + 1) & 0x7FFFFFFF or 1
        drv = driver.bindings()
        driver.check(drv.cuStreamWaitValue32(stream.handle, self._gate.device_ptr, self._gate_seq,
                                             drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ),
                     "cuStreamWaitValue32")

    def _gate_release(self) -> None:
        if self._gate is not None:
            self._gate_np[0] = self._gate_seq

    @property
    def last_advance_device_ms(self) -> float:
        """Profile mode: GPU time of the last advance (waits for it)."""
        if not self._events:
            return float("nan")
        self._events[3].synchronize()
        return self._events[2].elapsed_ms(self._events[3])

    def _list_dev(self) -> int:
        return self._list.device_ptr + _LIST_OFFSET

    def _delta(self, pages: npt.NDArray[np.int64], scanned: int) -> RegionDelta:
        n = len(pages) * self.page_bytes
        self._staging(n)
        assert self._staging_view is not None
        view = self._staging_view[:n]
        d = RegionDelta(self.spec, pages, view, scanned_bytes=scanned)
        self._last_delta = d
        return d

    def _direct_delta(self, pages: npt.NDArray[np.int64], ptr: int, nbytes: int, stream: driver.Stream,
                      scanned: int) -> RegionDelta:
        from .mapped import DevicePayload

        pad = len(pages) * self.page_bytes - nbytes
        d = RegionDelta(self.spec, pages, DevicePayload(ptr, nbytes, stream, pad=pad),  # type: ignore[arg-type]
                        scanned_bytes=scanned)
        self._last_delta = d
        self._needs_sync = False
        return d

    def _collect_full(self, stream: driver.Stream) -> RegionDelta:
        if self.direct and self.spec.nbytes >= DIRECT_MIN_BYTES:
            return self._direct_delta(np.arange(self.n_pages, dtype=np.int64), self.base, self.spec.nbytes, stream,
                                      self.spec.nbytes)
        buf = self._staging(self.padded_bytes)
        driver.memcpy_dtoh_async(buf.host_ptr, self.base, self.spec.nbytes, stream)
        stream.synchronize()
        self._needs_sync = False
        if self.padded_bytes > self.spec.nbytes:
            ctypes.memset(buf.host_ptr + self.spec.nbytes, 0, self.padded_bytes - self.spec.nbytes)
        return self._delta(np.arange(self.n_pages, dtype=np.int64), self.spec.nbytes)

    def _payload_device_ptr(self, delta: RegionDelta) -> int:
        """A device-readable address of the delta's payload (ours, or copied into ours)."""
        n = delta.payload.nbytes
        buf = self._staging(n)
        if n == 0:
            return buf.device_ptr
        if delta is self._last_delta:
            if self._dev_stage is not None and self.staging == "device" and len(delta.pages) < self.n_pages:
                return self._dev_stage.ptr  # the same bytes, already on the device
            return buf.device_ptr
        addr = ctypes.addressof(ctypes.c_char.from_buffer(delta.payload)) if not delta.payload.readonly else 0
        if addr == buf.host_ptr:
            if self._dev_stage is not None and self.staging == "device" and len(delta.pages) < self.n_pages:
                return self._dev_stage.ptr  # the same bytes, already on the device
            return buf.device_ptr
        buf.view(n)[:] = delta.payload
        return buf.device_ptr

    def _write_list(self, pages: npt.NDArray[np.int64]) -> int:
        """Put ``pages`` into the mapped list buffer (unless already there); return its device address."""
        n = len(pages)
        if n and pages is not self._list_holds and not np.array_equal(self._list_np[:n], pages):
            self._list_np[:n] = pages
        self._list_holds = pages
        return self._list_dev()

    def _is_full(self, delta: RegionDelta) -> bool:
        return delta.n_pages == self.n_pages

    def _gather_after_scan(self, stream: driver.Stream, meta_ptr: int, scanned: int) -> RegionDelta:
        """Detector has run (list + count on the device); stage the payload; return the delta."""
        m = self.mod
        if self.staging == "mapped":
            if self._gather_args is None:
                self._gather_args = m.gather_args(self.base, self._list_dev(), meta_ptr + 4, 0,
                                                  self._staging().device_ptr)
            m.launch("concordia_gather", self._gather_args, stream)
            if self.profile:
                self._events[1].record(stream)
                self._gate_release()
            stream.synchronize()
            count = int(self._count_np[0])
        else:
            if self.profile:
                self._events[1].record(stream)
            self._gate_release()
            stream.synchronize()
            if self.profile:
                self._events[2].record(stream)  # the part after the host learnt the count
            count = int(self._count_np[0])
            if count:
                need = count * self.page_bytes
                if self._dev_stage is None or self._dev_stage.nbytes < need:
                    if self._dev_stage is not None:
                        self._dev_stage.close()
                    self._dev_stage = DeviceBuffer(max(need, 64 * self.page_bytes))
                m.launch("concordia_gather",
                         m.gather_args(self.base, self._list_dev(), 0, count, self._dev_stage.ptr), stream,
                         grid=m.grid_for("concordia_gather", count))
                if self.direct and need >= DIRECT_MIN_BYTES:  # the log DMAs the gathered pages into its pages
                    pages = self._list_np[:count].copy()
                    self._list_holds = pages
                    return self._direct_delta(pages, self._dev_stage.ptr, need, stream, scanned)
                driver.memcpy_dtoh_async(self._staging(need).host_ptr, self._dev_stage.ptr, need, stream)
            if self.profile:
                self._events[3].record(stream)
            stream.synchronize()
        self._needs_sync = False
        if self.profile:
            self.last_collect_device_ms = self._events[0].elapsed_ms(self._events[1])
            if self.staging == "device":  # scan part + gather/DtoH part (host round trip excluded)
                self.last_collect_device_ms += self._events[2].elapsed_ms(self._events[3])
        pages = self._list_np[:count].copy()
        self._list_holds = pages
        return self._delta(pages, scanned)

    # ---- the Tracker contract ----
    def collect(self, *, full: bool) -> RegionDelta:
        driver.ensure_context(self.device)
        stream = self.stream
        if full or not self.initialised:
            return self._collect_full(stream)
        if self.profile:
            self._gate_hold(stream)
            self._events[0].record(stream)
        return self._collect_sparse(stream)

    def advance(self, delta: RegionDelta) -> None:
        if delta.spec.name != self.spec.name:
            raise ConfigError(f"advance: delta of region {delta.spec.name!r} given to tracker {self.spec.name!r}")
        driver.ensure_context(self.device)
        stream = self.stream
        if self._needs_sync:
            stream.synchronize()  # the last advance may still read the buffers we are about to rewrite
        if self.profile:
            self._gate_hold(stream)
            self._events[2].record(stream)
        self._advance(delta, stream)
        if self.profile:
            self._events[3].record(stream)
            self._gate_release()
        self._needs_sync = True
        self.initialised = True

    def restore(self, pages: npt.NDArray[np.int64], payload: memoryview) -> None:
        import torch

        driver.ensure_context(self.device)
        pages = np.ascontiguousarray(pages, dtype=np.int64)
        want = len(pages) * self.page_bytes
        if payload.nbytes != want:
            raise ConfigError(f"restore {self.spec.name!r}: payload is {payload.nbytes} bytes for "
                              f"{len(pages)} pages of {self.page_bytes} (want {want})")
        if len(pages) and (pages.min() < 0 or pages.max() >= self.n_pages):
            raise ConfigError(f"restore {self.spec.name!r}: page indices outside [0, {self.n_pages})")
        stream = self.stream
        if len(pages) == self.n_pages and _is_identity(pages):
            self._restore_whole(np.frombuffer(payload, dtype=np.uint8), stream)
        elif len(pages):
            src = np.frombuffer(payload, dtype=np.uint8)
            dev_payload = torch.empty(want, dtype=torch.uint8, device=self.tensor.device)
            dev_pages = torch.empty(len(pages), dtype=torch.int64, device=self.tensor.device)
            driver.memcpy_htod_async(dev_payload.data_ptr(), src.ctypes.data, want, stream)
            driver.memcpy_htod_async(dev_pages.data_ptr(), pages.ctypes.data, pages.nbytes, stream)
            m = self.mod
            m.launch("concordia_scatter",
                     m.list_args(self.base, dev_pages.data_ptr(), len(pages), dev_payload.data_ptr()), stream,
                     grid=m.grid_for("concordia_scatter", len(pages)))
            self._rebase(dev_pages.data_ptr(), dev_payload.data_ptr(), len(pages), stream)
            stream.synchronize()  # the sources are pageable / temporary
        # restored bytes are committed bytes: after a whole-region restore the next epoch is a delta
        self.initialised = len(pages) == self.n_pages or (self.initialised and len(pages) > 0)

    def _restore_whole(self, image: npt.NDArray[np.uint8], stream: driver.Stream) -> None:
        """The whole region from its padded image: ONE host-to-device copy of the region's real bytes straight
        into the tensor (a DMA at full PCIe speed when the image is page-locked, as recovery allocates it),
        then the detection state re-based on the device from the restored bytes. No page list, no scatter."""
        driver.memcpy_htod_async(self.base, image.ctypes.data, self.spec.nbytes, stream)
        keep = self._rebase_whole(image, stream)
        stream.synchronize()  # the caller may free the image (and ``keep``) as soon as this returns
        del keep

    def _rebase(self, dev_pages: int, dev_payload: int, n: int, stream: driver.Stream) -> None:
        """Make the detection state match restored pages (kinds with state override this)."""
        return None

    def _rebase_whole(self, image: npt.NDArray[np.uint8], stream: driver.Stream) -> Any:
        """Make the detection state match the whole restored region, enqueued after its copy on ``stream``.
        Returns host memory the enqueued work reads (kept alive until the stream is synchronized)."""
        return None

    def close(self) -> None:
        for b in (self._payload, self._list, self._dev_stage, self._gate, self._snap, self._flag_snap):
            if b is not None:
                b.close()
        for e in self._events:
            e.close()
        if self._ready is not None:
            self._ready.close()
        if self._side_stream is not None:
            self._side_stream.close()

    # ---- asynchronous epochs (Runtime.checkpoint_async) ----
    @property
    def snapshot_device_bytes(self) -> int:
        """Device memory held for asynchronous snapshots (0 until the first ``stage``)."""
        return sum(b.nbytes for b in (self._snap, self._flag_snap) if b is not None)

    def _snapshot(self) -> DeviceBuffer:
        if self._snap is None:
            self._snap = DeviceBuffer(self.padded_bytes)
        return self._snap

    def _side(self) -> driver.Stream:
        if self._side_stream is None:
            self._side_stream = driver.Stream.create(non_blocking=True, device=self.device)
        return self._side_stream

    def stage(self, *, full: bool) -> CudaStaged:
        """Snapshot this epoch's pages in stream order after the caller's work; no host synchronisation."""
        driver.ensure_context(self.device)
        stream = self.stream
        if self._ready is None:
            self._ready = driver.Event(timing=False)
        self._side()
        source = self._stage_work(stream, full or not self.initialised)
        self._ready.record(stream)
        return CudaStaged(self, source)

    def _stage_copy_all(self, stream: driver.Stream) -> str:
        snap = self._snapshot()
        if self.padded_bytes > self.spec.nbytes:  # a sparse gather may have left page bytes in the pad
            driver.memset_d8_async(snap.ptr + self.spec.nbytes, 0, self.padded_bytes - self.spec.nbytes, stream)
        driver.memcpy_dtod_async(snap.ptr, self.base, self.spec.nbytes, stream)
        return _ALL

    def _stage_gather(self, stream: driver.Stream, meta_ptr: int) -> str:
        """After a detector: gather the listed pages into the snapshot, the count read on the device."""
        if self._stage_gather_args is None:
            self._stage_gather_args = self.mod.gather_args(self.base, self._list_dev(), meta_ptr + 4, 0,
                                                           self._snapshot().ptr)
        self.mod.launch("concordia_gather", self._stage_gather_args, stream)
        return _LISTED

    def _finish_stage(self, source: str) -> RegionDelta:
        """Background writer: wait for the snapshot, copy it DtoH into the pinned staging buffer."""
        driver.ensure_context(self.device)
        ready, side, pb = self._ready, self._side(), self.page_bytes
        assert ready is not None, "finish of a stage that never ran"
        if source == _NONE:
            return RegionDelta(self.spec, np.zeros(0, dtype=np.int64), memoryview(b""))
        if source == _LISTED:
            ready.synchronize()  # the detector's count and page list are in mapped host memory
            count = int(self._count_np[0])
            pages = self._list_np[:count].copy()
            src, nbytes, scanned = self._snapshot().ptr, count * pb, self._staged_scan_bytes()
        else:
            side.wait_event(ready)
            pages = np.arange(self.n_pages, dtype=np.int64)
            live = source == _LIVE
            src = self.base if live else self._snapshot().ptr
            nbytes, scanned = (self.spec.nbytes if live else self.padded_bytes), self.spec.nbytes
        if self.placed_async and nbytes >= DIRECT_MIN_BYTES:  # DMA'd by the log into its own pages, on ``side``
            from .mapped import DevicePayload

            side.wait_event(ready)  # (the listed case synchronised already; this orders the copy on ``side``)
            pad = len(pages) * pb - nbytes
            self._list_holds = pages
            payload = DevicePayload(src, nbytes, side, pad=pad)
            return RegionDelta(self.spec, pages, payload, scanned_bytes=scanned)  # type: ignore[arg-type]
        buf = self._staging(len(pages) * pb)
        driver.memcpy_dtoh_async(buf.host_ptr, src, nbytes, side)
        side.synchronize()
        if source == _LIVE and self.padded_bytes > self.spec.nbytes:
            ctypes.memset(buf.host_ptr + self.spec.nbytes, 0, self.padded_bytes - self.spec.nbytes)
        self._list_holds = pages
        assert self._staging_view is not None
        return RegionDelta(self.spec, pages, self._staging_view[: len(pages) * pb], scanned_bytes=scanned)

    def _commit_stage(self, source: str, delta: RegionDelta) -> None:
        """Background writer, after the commit: advance from the snapshot (the committed bytes), then wait
        for it, so the caller's next stage (which waits for this epoch) scans against the advanced state."""
        driver.ensure_context(self.device)
        if delta.n_pages:
            side = self._side()
            self._advance_staged(source, delta, side)
            side.synchronize()
        self.initialised = True

    def _staged_scan_bytes(self) -> int:
        return self.spec.nbytes

    def _advance_staged(self, source: str, delta: RegionDelta, side: driver.Stream) -> None:
        return None

    def _abandon_stage(self, source: str) -> None:
        return None

    # ---- per kind ----
    def _collect_sparse(self, stream: driver.Stream) -> RegionDelta:
        return self._collect_full(stream)

    def _advance(self, delta: RegionDelta, stream: driver.Stream) -> None:
        return None

    def _stage_work(self, stream: driver.Stream, full: bool) -> str:
        return self._stage_copy_all(stream)


class CudaStaged:
    """A CUDA region's share of an asynchronous epoch (core/tracking.py's StagedDelta)."""

    def __init__(self, tracker: CudaTracker, source: str) -> None:
        self.spec = tracker.spec
        self.source = source
        self._tracker = tracker

    def result(self) -> RegionDelta:
        return self._tracker._finish_stage(self.source)

    def commit(self, delta: RegionDelta) -> None:
        self._tracker._commit_stage(self.source, delta)

    def abandon(self) -> None:
        self._tracker._abandon_stage(self.source)


class DenseTracker(CudaTracker):
    """Every page is dirty every epoch: one DtoH of the region, no scan."""

    def collect(self, *, full: bool) -> RegionDelta:
        return super().collect(full=True)


class CudaDenseBatch:
    """The dense regions of one device, staged together by asynchronous epochs (core/tracking.py's DenseBatch).

    Members are laid out in the snapshot in address order (so regions adjacent in memory share a copy). The
    first stage allocates the snapshot (zeroed on the caller's stream, before the first copies: the copies
    never write a padded tail, so it stays zero), an event and a side stream. Each stage is then: torch's
    current stream, the planned D2D copies, one event record; no host synchronisation. The background writer
    waits for the event on the side stream, then either hands the log each member's snapshot bytes as a device
    payload (a mapped, registered DRAM log: ``placed_async``; the log DMAs them into its own pages) or copies
    them DtoH into the tracker's pinned staging buffer and synchronises the side stream once."""

    def __init__(self, trackers: list[DenseTracker]) -> None:
        members = sorted(trackers, key=lambda t: t.base)
        devices = {t.device for t in members}
        if len(devices) != 1:
            raise AssertionError(f"one batch per device; got devices {sorted(devices)}")
        self.trackers = members
        self.specs = [t.spec for t in members]
        self.device = members[0].device
        self._lead = members[0]  # its stream (torch's current one, unless the tracker was given a stream)
        self.offsets = list(np.cumsum([0] + [t.padded_bytes for t in members[:-1]]).tolist())
        self.padded_bytes = sum(t.padded_bytes for t in members)
        self.copies = plan_dense_copies([(t.base, t.spec.nbytes, t.padded_bytes) for t in members])
        self._pages = [np.arange(t.n_pages, dtype=np.int64) for t in members]
        for p in self._pages:
            p.flags.writeable = False
        self._snap: DeviceBuffer | None = None
        self._ready: driver.Event | None = None
        self._side: driver.Stream | None = None

    def stage(self) -> CudaStagedBatch:
        """Snapshot every member in stream order after the caller's work; no host synchronisation."""
        driver.ensure_context(self.device)
        stream = self._lead.stream
        if self._snap is None:
            self._snap = DeviceBuffer(self.padded_bytes)
            driver.memset_d8_async(self._snap.ptr, 0, self.padded_bytes, stream)  # ordered before the copies
            self._ready = driver.Event(timing=False)
            self._side = driver.Stream.create(non_blocking=True, device=self.device)
        base = self._snap.ptr
        for off, src, nbytes in self.copies:
            driver.memcpy_dtod_async(base + off, src, nbytes, stream)
        assert self._ready is not None
        self._ready.record(stream)
        return CudaStagedBatch(self)

    def _results(self) -> list[RegionDelta]:
        """Background writer: wait for the snapshot, copy each member DtoH into its pinned staging buffer."""
        driver.ensure_context(self.device)
        side, ready, snap = self._side, self._ready, self._snap
        assert side is not None and ready is not None and snap is not None, "results of a stage that never ran"
        side.wait_event(ready)
        # members the log takes as device payloads (a mapped, registered log): DMA'd from the snapshot straight
        # into the log's pages when it places them, on ``side`` after the snapshot (the snapshot's padded tails
        # are zero); the others through their pinned staging buffers, as before
        placed = [t.placed_async and t.padded_bytes >= DIRECT_MIN_BYTES for t in self.trackers]
        for t, off, pl in zip(self.trackers, self.offsets, placed, strict=True):
            if not pl:
                driver.memcpy_dtoh_async(t._staging(t.padded_bytes).host_ptr, snap.ptr + off, t.padded_bytes, side)
        if not all(placed):
            side.synchronize()
        out = []
        for t, pages, off, pl in zip(self.trackers, self._pages, self.offsets, placed, strict=True):
            if pl:
                from .mapped import DevicePayload

                payload = DevicePayload(snap.ptr + off, t.padded_bytes, side, keep=self)
                out.append(RegionDelta(t.spec, pages, payload, scanned_bytes=t.spec.nbytes))  # type: ignore[arg-type]
                continue
            assert t._staging_view is not None
            out.append(RegionDelta(t.spec, pages, t._staging_view[: t.padded_bytes], scanned_bytes=t.spec.nbytes))
        return out

    @property
    def snapshot_device_bytes(self) -> int:
        return self._snap.nbytes if self._snap is not None else 0

    def close(self) -> None:
        if self._snap is not None:
            self._snap.close()
            self._snap = None
        if self._ready is not None:
            self._ready.close()
            self._ready = None
        if self._side is not None:
            self._side.close()
            self._side = None


class CudaStagedBatch:
    """A CudaDenseBatch's share of an asynchronous epoch (core/tracking.py's StagedBatch)."""

    def __init__(self, batch: CudaDenseBatch) -> None:
        self._batch = batch

    def results(self) -> list[RegionDelta]:
        return self._batch._results()

    def commit(self) -> None:
        for t in self._batch.trackers:
            t.initialised = True

    def abandon(self) -> None:
        return None


def batch_dense(trackers: list[DenseTracker]) -> list[CudaDenseBatch]:
    """One CudaDenseBatch per device (and per fixed stream) for the dense regions of a runtime."""
    groups: dict[tuple[int, int], list[DenseTracker]] = {}
    for t in trackers:
        key = (t.device, 0 if t._stream is None else t._stream.handle)
        groups.setdefault(key, []).append(t)
    return [CudaDenseBatch(ts) for ts in groups.values()]


class ImmutableTracker(CudaTracker):
    """Every page at the first epoch (or when asked for full), nothing afterwards."""

    def _collect_sparse(self, stream: driver.Stream) -> RegionDelta:
        return self._delta(np.zeros(0, dtype=np.int64), 0)

    def _stage_work(self, stream: driver.Stream, full: bool) -> str:
        return _LIVE if full else _NONE  # no snapshot: the region never changes (that is its contract)


class OpaqueTracker(CudaTracker):
    """Shadow diff or page hash over the whole region, on the whole GPU."""

    def __init__(self, spec: RegionSpec, tensor: Any, **kw: Any) -> None:
        super().__init__(spec, tensor, **kw)
        self.mode = spec.diff
        words = (self.n_pages + 31) // 32
        self._meta = DeviceBuffer(16 + 4 * words, zero=True)  # meta[0]: blocks done, meta[1]: count; bitmap
        if self.mode is DiffMode.SHADOW:
            self._state = DeviceBuffer(spec.nbytes)
            kernel = "concordia_scan_shadow"
        else:
            self._state = DeviceBuffer(8 * self.n_pages, zero=True)
            kernel = "concordia_scan_hash"
        self._scan_kernel = kernel
        self._scan_args = self.mod.scan_args(self.base, self._state.ptr, self._meta.ptr + 16, self._meta.ptr,
                                             self._list_dev(), self._list.device_ptr)

    @property
    def device_state_bytes(self) -> int:
        """Device memory this tracker holds for detection (state + bitmap + meta)."""
        return self._state.nbytes + self._meta.nbytes

    def _collect_sparse(self, stream: driver.Stream) -> RegionDelta:
        self.mod.launch(self._scan_kernel, self._scan_args, stream)
        scanned = self.spec.nbytes * (2 if self.mode is DiffMode.SHADOW else 1)
        return self._gather_after_scan(stream, self._meta.ptr, scanned)

    def _rebase(self, dev_pages: int, dev_payload: int, n: int, stream: driver.Stream) -> None:
        m = self.mod
        g = m.grid_for("concordia_scatter", n)
        if self.mode is DiffMode.SHADOW:
            m.launch("concordia_scatter", m.list_args(self._state.ptr, dev_pages, n, dev_payload), stream, grid=g)
        else:
            m.launch("concordia_hash_store", m.list_args(dev_payload, dev_pages, n, self._state.ptr), stream, grid=g)

    def _rebase_whole(self, image: npt.NDArray[np.uint8], stream: driver.Stream) -> Any:
        if self.mode is DiffMode.SHADOW:
            driver.memcpy_dtod_async(self._state.ptr, self.base, self.spec.nbytes, stream)
            return None
        # hash every whole page where it now lies on the device; a partial last page (the region is not a
        # whole number of pages) is hashed on the host, zero-padded exactly as the scan kernel pads it
        pb = self.page_bytes
        tail = self.spec.nbytes - (self.n_pages - 1) * pb
        whole = self.n_pages if tail == pb else self.n_pages - 1
        m = self.mod
        if whole:
            m.launch("concordia_hash_store", m.list_args(self.base, 0, whole, self._state.ptr), stream,
                     grid=m.grid_for("concordia_hash_store", whole))
        if whole == self.n_pages:
            return None
        last = np.zeros(pb, dtype=np.uint8)
        last[:tail] = image[whole * pb : whole * pb + tail]
        h = reference_page_hash(last, pb)
        driver.memcpy_htod_async(self._state.ptr + 8 * whole, h.ctypes.data, 8, stream)
        return h

    def _advance(self, delta: RegionDelta, stream: driver.Stream) -> None:
        n = delta.n_pages
        if n == 0:
            return
        m = self.mod
        payload = self._payload_device_ptr(delta)
        if self._is_full(delta):
            if self.mode is DiffMode.SHADOW:
                driver.memcpy_htod_async(self._state.ptr, self._staging().host_ptr, self.spec.nbytes, stream)
            else:
                m.launch("concordia_hash_store", m.list_args(payload, 0, n, self._state.ptr), stream)
            return
        lst = self._write_list(delta.pages)
        g = m.grid_for("concordia_scatter", n)
        if self._adv_args is None:
            self._adv_args = (m.list_args(self._state.ptr, lst, n, payload) if self.mode is DiffMode.SHADOW
                              else m.list_args(payload, lst, n, self._state.ptr))
        a = self._adv_args
        a.set(2, n)
        if self.mode is DiffMode.SHADOW:
            a.set(3, payload)
            m.launch("concordia_scatter", a, stream, grid=g)
        else:
            a.set(0, payload)
            m.launch("concordia_hash_store", a, stream, grid=g)

    def _stage_work(self, stream: driver.Stream, full: bool) -> str:
        if full:
            return self._stage_copy_all(stream)
        self.mod.launch(self._scan_kernel, self._scan_args, stream)
        return self._stage_gather(stream, self._meta.ptr)

    def _staged_scan_bytes(self) -> int:
        return self.spec.nbytes * (2 if self.mode is DiffMode.SHADOW else 1)

    def _advance_staged(self, source: str, delta: RegionDelta, side: driver.Stream) -> None:
        m, n, snap, state = self.mod, delta.n_pages, self._snapshot().ptr, self._state.ptr
        if source == _ALL:
            if self.mode is DiffMode.SHADOW:
                driver.memcpy_dtod_async(state, snap, self.spec.nbytes, side)
            else:
                m.launch("concordia_hash_store", m.list_args(snap, 0, n, state), side)
            return
        lst = self._write_list(delta.pages)
        g = m.grid_for("concordia_scatter", n)
        if self.mode is DiffMode.SHADOW:
            m.launch("concordia_scatter", m.list_args(state, lst, n, snap), side, grid=g)
        else:
            m.launch("concordia_hash_store", m.list_args(snap, lst, n, state), side, grid=g)

    def close(self) -> None:
        super().close()
        self._state.close()
        self._meta.close()


class PagedTracker(CudaTracker):
    """The owner's per-block dirty flags say which KV blocks changed; no scan of the data."""

    def __init__(self, spec: RegionSpec, tensor: Any, dirty_blocks: Any, **kw: Any) -> None:
        super().__init__(spec, tensor, **kw)
        if dirty_blocks is None:
            raise RegionError(f"paged region {spec.name!r}: pass dirty_blocks (uint8/bool CUDA tensor of "
                              f"{spec.n_blocks} flags, one per KV block)")
        if (not getattr(dirty_blocks, "is_cuda", False) or dirty_blocks.element_size() != 1
                or dirty_blocks.numel() != spec.n_blocks or not dirty_blocks.is_contiguous()
                or dirty_blocks.device != tensor.device):
            raise RegionError(
                f"paged region {spec.name!r}: dirty_blocks must be a contiguous 1-byte CUDA tensor of "
                f"{spec.n_blocks} flags on {tensor.device}; got {tuple(dirty_blocks.shape)} "
                f"{dirty_blocks.dtype} on {dirty_blocks.device}")
        self.dirty_blocks = dirty_blocks
        self._snap_scan_args: driver.KernelArgs | None = None
        self._meta = DeviceBuffer(16, zero=True)
        self._scan_args = self.mod.paged_scan_args(int(dirty_blocks.data_ptr()), self._meta.ptr,
                                                   self._list_dev(), self._list.device_ptr)
        self.initialised = True  # the flags ARE the state: no base needed to find changes

    def collect(self, *, full: bool) -> RegionDelta:
        driver.ensure_context(self.device)
        stream = self.stream
        if full:
            return self._collect_full(stream)
        if self.profile:
            self._gate_hold(stream)
            self._events[0].record(stream)
        self.mod.launch("concordia_paged_scan", self._scan_args, stream)
        return self._gather_after_scan(stream, self._meta.ptr, self.spec.n_blocks)

    def _advance(self, delta: RegionDelta, stream: driver.Stream) -> None:
        n = delta.n_pages
        if n == 0:
            return
        lst = self._write_list(delta.pages)
        m = self.mod
        m.launch("concordia_paged_clear", m.list_args(int(self.dirty_blocks.data_ptr()), lst, n, 0), stream,
                 grid=max(1, min(m.sms, -(-n // 256))))

    def _stage_work(self, stream: driver.Stream, full: bool) -> str:
        """Take the flags: copy them to a device snapshot and clear them, in stream order. A block flagged
        after this belongs to the next epoch; the scan reads the snapshot."""
        n = self.spec.n_blocks
        if self._flag_snap is None:
            self._flag_snap = DeviceBuffer(max(1, n))
            self._snap_scan_args = self.mod.paged_scan_args(self._flag_snap.ptr, self._meta.ptr, self._list_dev(),
                                                            self._list.device_ptr)
        flags = int(self.dirty_blocks.data_ptr())
        driver.memcpy_dtod_async(self._flag_snap.ptr, flags, n, stream)
        driver.memset_d8_async(flags, 0, n, stream)
        if full:
            return self._stage_copy_all(stream)
        assert self._snap_scan_args is not None
        self.mod.launch("concordia_paged_scan", self._snap_scan_args, stream)
        return self._stage_gather(stream, self._meta.ptr)

    def _staged_scan_bytes(self) -> int:
        return self.spec.n_blocks

    def _abandon_stage(self, source: str) -> None:
        """The epoch failed: flag again every block the stage took (OR, so flags set meanwhile stay set)."""
        if self._flag_snap is None or self._ready is None:
            return
        driver.ensure_context(self.device)
        side, n = self._side(), self.spec.n_blocks
        side.wait_event(self._ready)
        taken = np.zeros(max(1, n), dtype=np.uint8)
        driver.memcpy_dtoh_async(taken.ctypes.data, self._flag_snap.ptr, n, side)
        side.synchronize()
        flags = int(self.dirty_blocks.data_ptr())
        for start, length in pages_to_runs(np.flatnonzero(taken[:n]).astype(np.int64)):
            driver.memset_d8_async(flags + int(start), 1, int(length), side)
        side.synchronize()

    def close(self) -> None:
        super().close()
        self._meta.close()


def _is_identity(pages: npt.NDArray[np.int64]) -> bool:
    """pages == [0, 1, ..., len-1] (ascending, no gaps): a whole-region restore."""
    n = len(pages)
    return n > 0 and int(pages[0]) == 0 and int(pages[-1]) == n - 1 and bool((np.diff(pages) == 1).all())


def make_cuda_tracker(spec: RegionSpec, tensor: Any, *, dirty_blocks: Any = None,
                      stream: driver.Stream | None = None, staging: str | None = None, profile: bool = False
                      ) -> CudaTracker:
    """The Tracker for a CUDA tensor registered as ``spec`` (runtime.py calls exactly this)."""
    kind = spec.kind
    if kind is RegionKind.SCRATCH:
        raise RegionError(f"region {spec.name!r} is scratch: scratch regions are never tracked or recovered")
    if staging is None:  # paged: few flagged blocks per epoch, learn the count first; others: gather mapped
        staging = "device" if kind is RegionKind.PAGED else "mapped"
    kw: dict[str, Any] = {"stream": stream, "staging": staging, "profile": profile}
    if kind is RegionKind.OPAQUE:
        return OpaqueTracker(spec, tensor, **kw)
    if kind is RegionKind.PAGED:
        return PagedTracker(spec, tensor, dirty_blocks, **kw)
    if kind is RegionKind.DENSE:
        return DenseTracker(spec, tensor, **kw)
    return ImmutableTracker(spec, tensor, **kw)
