"""Runtime: the region registry + a backend per region + the recovery log.

``checkpoint()`` collects every region's dirty pages, appends them (with the session metadata) as ONE
epoch, and returns only once that epoch is committed per the fsync policy; trackers advance only after the
commit, so a failed epoch is found again by the next one. ``recover()`` replays a log into host arrays in
any process; ``Runtime.recover_into()`` restores registered buffers (host or GPU) in place.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .core.compaction import CompactionResult, compact_with_writer
from .core.log import LogOptions, OpenReport, RecoveryLog
from .core.regions import DiffMode, MemoryRange, RegionKind, RegionSpec, RegionTable, check_page_bytes
from .core.replay import Outcome, RegionImage, ReplayOptions, ReplayResult, ReplayTimings, TailInfo, replay
from .core.tracking import RegionDelta, Tracker
from .cpu.trackers import CpuTracker
from .errors import ConcordiaError, ConfigError, RecoveryError, RegionError

log = logging.getLogger("concordia_ft.runtime")


# ----------------------------------------------------------------------------------------- buffers
def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def describe_buffer(buf: Any) -> tuple[str, tuple[int, ...], MemoryRange]:
    """dtype string, shape and memory range of a numpy array or torch tensor (contiguous)."""
    if _is_torch(buf):
        if not buf.is_contiguous():
            raise RegionError("register a contiguous tensor (call .contiguous() and register that buffer)")
        nbytes = buf.numel() * buf.element_size()
        return str(buf.dtype), tuple(buf.shape), MemoryRange(str(buf.device), buf.data_ptr(), nbytes)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise RegionError("register a C-contiguous array (np.ascontiguousarray makes a copy you can register)")
        if not buf.flags.writeable:
            raise RegionError("the array is read-only; register a writable array so recovery can restore into it")
        return str(buf.dtype), tuple(buf.shape), MemoryRange("cpu", buf.__array_interface__["data"][0], buf.nbytes)
    raise RegionError(f"register a numpy array or a torch tensor, got {type(buf).__name__}")


def host_bytes(buf: Any) -> npt.NDArray[np.uint8]:
    """A writable 1-D uint8 view of a host buffer's bytes (no copy)."""
    if _is_torch(buf):
        import torch

        t = buf.detach()
        return t.reshape(-1).view(torch.uint8).numpy()  # type: ignore[no-any-return]
    return buf.reshape(-1).view(np.uint8)  # type: ignore[no-any-return]


def _any_nonzero(buf: Any) -> bool:
    if _is_torch(buf):
        import torch

        return bool(buf.detach().reshape(-1).view(torch.uint8).any())
    return bool(buf.reshape(-1).view(np.uint8).any())


def _pinned_or_pageable(nbytes: int) -> Any:
    """Page-locked host memory for a GPU region's image; pageable memory (slower DMA) when pinning fails."""
    from .cuda.memory import pinned_host_array

    try:
        return pinned_host_array(nbytes)
    except (RuntimeError, ConcordiaError) as e:
        log.warning("could not pin %d bytes of host memory for recovery (%s); restoring from pageable memory, "
                    "which copies to the GPU several times slower", nbytes, e)
        return np.empty(nbytes, dtype=np.uint8)


def _bitmap(buf: Any) -> Any:
    if buf is None or not _is_torch(buf) or buf.is_cuda:
        return buf
    return buf.numpy()


# ----------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class RecoveryOptions:
    """How replay and restore use the machine. What is recovered, and every check on the way, is the same
    under every option: these trade only time (benchmarks compare them in one run)."""

    threads: int | None = None  # replay's checksum and copy threads (None: automatic, 1: the calling thread)
    parallel_verify: bool = True  # False: payload checksums one after another on one thread
    pinned: bool = True  # GPU regions: replay into page-locked host memory, restored with one DMA per region

    @classmethod
    def coerce(cls, value: RecoveryOptions | Mapping[str, Any] | None) -> RecoveryOptions:
        if value is None:
            return cls()
        if isinstance(value, RecoveryOptions):
            return value
        if isinstance(value, Mapping):
            try:
                return cls(**value)
            except TypeError as e:
                raise ConfigError(f"unknown recovery option: {e}") from None
        raise ConfigError(f"recovery options must be RecoveryOptions or a dict, got {type(value).__name__}")

    def replay_options(self) -> ReplayOptions:
        return ReplayOptions(threads=self.threads, parallel_verify=self.parallel_verify)


# ----------------------------------------------------------------------------------------- results
@dataclass
class CheckpointStats:
    epoch: int
    pages: int
    payload_bytes: int
    total_bytes: int
    full_bytes: int  # bytes of every recovered region: what a full copy would write
    seconds: float
    detect_seconds: float
    append_seconds: float
    region_pages: dict[str, int] = field(default_factory=dict)

    @property
    def reduction(self) -> float:
        return self.full_bytes / max(1, self.payload_bytes)


@dataclass
class Recovered:
    """A verified state from the log: the last committed epoch, its regions' exact bytes and its metadata."""

    epoch: int
    outcome: Outcome
    meta: Any
    images: dict[str, RegionImage]
    tail: TailInfo | None = None
    seconds: float = 0.0
    timings: ReplayTimings = field(default_factory=ReplayTimings)  # the replay's passes (verify may predate)
    restore_s: float = 0.0  # recover_into: copying the images into the registered buffers

    @property
    def regions(self) -> dict[str, npt.NDArray[np.uint8]]:
        return {n: img.data for n, img in self.images.items()}

    @property
    def specs(self) -> dict[str, RegionSpec]:
        return {n: img.spec for n, img in self.images.items()}

    def array(self, name: str) -> npt.NDArray[Any]:
        """The region as a numpy array of its registered dtype and shape (numpy dtypes only)."""
        spec = self.images[name].spec
        if spec.dtype.startswith("torch."):
            raise ConfigError(f"region {name!r} holds {spec.dtype}; use .tensor({name!r}) for torch dtypes")
        return self.images[name].data.view(np.dtype(spec.dtype)).reshape(spec.shape)

    def tensor(self, name: str, device: str | None = None) -> Any:
        """The region as a torch tensor of its registered dtype and shape (a copy, on ``device``)."""
        import torch

        spec = self.images[name].spec
        raw = torch.from_numpy(self.images[name].data.copy())
        dtype = getattr(torch, spec.dtype.removeprefix("torch.")) if spec.dtype else torch.uint8
        t = raw.view(dtype).reshape(spec.shape)
        return t.to(device) if device else t


def _recovered(res: ReplayResult, t0: float) -> Recovered:
    _check_epoch(res)
    assert res.epoch is not None
    return Recovered(res.epoch, res.outcome, res.meta, res.regions, res.tail, time.perf_counter() - t0,
                     res.timings)


def _check_epoch(res: ReplayResult) -> None:
    if res.epoch is None:
        raise RecoveryError(f"nothing to recover: the log holds no committed epoch (outcome {res.outcome.value})")


def recover(log_dir: str | Path, *, verify: bool = True,
            options: RecoveryOptions | Mapping[str, Any] | None = None) -> Recovered:
    """Replay ``log_dir`` (base + committed suffix, checksums verified) into host arrays."""
    t0 = time.perf_counter()
    path = Path(log_dir)
    if not path.exists():
        raise RecoveryError(f"no log at {path}: the directory does not exist")
    opts = RecoveryOptions.coerce(options)
    return _recovered(replay(path, verify_payloads=verify, options=opts.replay_options()), t0)


def open_to_recover(log_dir: str | Path, key: str, what: str, *, fsync: str = "never", backend: str = "file",
                    runtime_options: dict[str, Any] | None = None) -> tuple[Runtime, Any]:
    """Open an existing log for a component that restores itself from it (a Session, a LoRA trainer).

    Returns the Runtime (which has replayed and verified the log once) and the ``key`` section of the last
    committed epoch's metadata. The caller registers its buffers and calls ``recover_into()``; it must close
    the Runtime if it gives up."""
    if not Path(log_dir).is_dir():
        raise RecoveryError(f"no log at {log_dir}: the directory does not exist")
    rt = Runtime(str(log_dir), fsync=fsync, backend=backend, **(runtime_options or {}))
    section = (rt.opened_meta or {}).get(key) if isinstance(rt.opened_meta, dict) else None
    if section is None:
        epoch = rt.epoch
        rt.close()
        raise RecoveryError(f"the last epoch ({epoch}) in {log_dir} holds no {what} metadata; was this log "
                            f"written by {what}?" if epoch is not None else f"{log_dir} holds no committed epoch")
    return rt, section


# ------------------------------------------------------------------------------------------- runtime
class Runtime:
    """Registers regions, checkpoints them as committed epochs, and restores them."""

    def __init__(self, log_dir: str | Path, fsync: str = "always", *, backend: str = "file",
                 fsync_interval_ms: int = 100, page_bytes: int = 4096, segment_max_bytes: int = 1 << 30,
                 compact_after_bytes: int | None = 256 << 20, background_compaction: bool = True,
                 device_handlers: str = "auto", recovery: RecoveryOptions | Mapping[str, Any] | None = None
                 ) -> None:
        self.page_bytes = check_page_bytes(page_bytes)
        if device_handlers not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"device_handlers must be 'auto', 'cuda' or 'cpu', got {device_handlers!r}")
        self.device_handlers = device_handlers
        self.recovery = RecoveryOptions.coerce(recovery)
        self.log = RecoveryLog.open(log_dir, LogOptions(fsync=fsync, fsync_interval_ms=fsync_interval_ms,
                                                        backend=backend, segment_max_bytes=segment_max_bytes),
                                    replay_options=self.recovery.replay_options())
        self.log_dir = Path(log_dir)
        self.table = RegionTable()
        self._trackers: dict[str, Tracker] = {}
        self._buffers: dict[str, Any] = {}
        self._pending_defs: dict[str, RegionSpec] = {}
        self._pending_drops: list[str] = []
        self._needs_full: set[str] = set()
        self._mutex = threading.RLock()
        self._compact_after = compact_after_bytes
        self._background = background_compaction
        self._appended_since_compact = 0
        self._compactor: threading.Thread | None = None
        self.last_compaction: CompactionResult | None = None
        self.compaction_error: BaseException | None = None
        self.last_stats: CheckpointStats | None = None
        replayed = self.log.replayed
        self.opened_meta: Any = replayed.meta if replayed is not None else None  # the log's last metadata at open

    # --------------------------------------------------------------------------------------- registry
    @property
    def open_report(self) -> OpenReport:
        return self.log.report

    @property
    def epoch(self) -> int | None:
        """The last committed epoch (of this log, including earlier processes)."""
        return self.log.last_epoch

    def register(self, name: str, buf: Any, kind: str | RegionKind = "opaque", *, page_bytes: int | None = None,
                 block_bytes: int = 0, dirty_blocks: Any = None, diff: str | DiffMode | None = None,
                 initially_zero: bool = False) -> RegionSpec:
        """Register ``buf`` (numpy array or torch tensor, contiguous) under ``name``.

        ``diff`` (opaque regions): "hash" (8 bytes of state per page, one read of the region) or "shadow"
        (an exact copy, two reads). Default: "hash" for GPU tensors, where it is the faster of the two at
        HBM speed (cuda/DESIGN.md has the numbers), "shadow" in host memory, where numpy compares faster than
        it hashes.

        ``dirty_blocks`` (paged regions): the owner's flags, one per block; ``checkpoint()`` reads them and, once
        the epoch commits, clears the ones it logged. Flag blocks before calling ``checkpoint()`` (on a GPU: in
        stream order before it), not concurrently with it: a block re-flagged while an epoch is being written
        is cleared with it, and its newer bytes wait for the block's next write.

        ``initially_zero`` (paged regions): the buffer is all zeros now (a fresh KV arena), so its first epoch
        logs only the flagged blocks instead of the whole region; recovery recreates the rest as zeros.
        Checked here (one pass over the buffer), since a wrong promise would lose data.
        """
        with self._mutex:
            kind = RegionKind.parse(kind)
            dtype, shape, where = describe_buffer(buf)
            if diff is None:
                diff = DiffMode.HASH if where.device.startswith("cuda") else DiffMode.SHADOW
            if where.nbytes == 0:
                raise RegionError(f"region {name!r} is empty (0 bytes); register a buffer with data")
            spec = RegionSpec(name=name, kind=kind, nbytes=where.nbytes, page_bytes=page_bytes or self.page_bytes,
                              dtype=dtype, shape=shape, block_bytes=block_bytes, diff=DiffMode.parse(diff))
            if kind is RegionKind.PAGED and dirty_blocks is None:
                raise RegionError(f"paged region {name!r} needs dirty_blocks= (a bitmap of {spec.n_blocks} blocks)")
            if initially_zero:
                if kind is not RegionKind.PAGED:
                    raise RegionError(f"initially_zero applies to paged regions only; {name!r} is {kind.value}")
                if _any_nonzero(buf):
                    raise RegionError(f"region {name!r} was registered with initially_zero=True but holds nonzero "
                                      "bytes; register it before writing to it, or drop initially_zero")
            tracker = None if kind is RegionKind.SCRATCH else self._make_tracker(spec, buf, dirty_blocks, where)
            self.table.add(spec, where)
            self._buffers[name] = buf
            if tracker is not None:
                self._trackers[name] = tracker
                self._pending_defs[name] = spec
                if not initially_zero:
                    self._needs_full.add(name)
                if name in self._pending_drops:
                    self._pending_drops.remove(name)
            return spec

    def _make_tracker(self, spec: RegionSpec, buf: Any, dirty_blocks: Any, where: MemoryRange) -> Tracker:
        if where.device.startswith("cuda"):
            if self.device_handlers == "cpu":
                raise ConfigError(f"region {spec.name!r} is on {where.device} but device_handlers='cpu'")
            from .cuda.trackers import make_cuda_tracker

            return make_cuda_tracker(spec, buf, dirty_blocks=dirty_blocks)  # type: ignore[no-any-return]
        try:
            # a paged tracker's bitmap is its state: it needs no full first epoch unless the runtime asks
            return CpuTracker(spec, host_bytes(buf), _bitmap(dirty_blocks), synced=spec.kind is RegionKind.PAGED)
        except ValueError as e:
            raise RegionError(str(e)) from None

    def unregister(self, name: str) -> None:
        with self._mutex:
            self.table.remove(name)
            self._buffers.pop(name, None)
            tracker = self._trackers.pop(name, None)
            if tracker is not None:
                tracker.close()
                if self._pending_defs.pop(name, None) is None:
                    self._pending_drops.append(name)
                self._needs_full.discard(name)

    # ------------------------------------------------------------------------------------- checkpoint
    def checkpoint(self, meta: Any = None) -> int:
        """Commit every region's dirty pages and ``meta`` (JSON-able) as one epoch; return its number."""
        with self._mutex:
            t0 = time.perf_counter()
            deltas: list[RegionDelta] = []
            for name, tracker in self._trackers.items():
                deltas.append(tracker.collect(full=name in self._needs_full))
            t1 = time.perf_counter()
            res = self.log.append(defs=list(self._pending_defs.values()), drops=self._pending_drops,
                                  deltas=deltas, meta=meta)
            t2 = time.perf_counter()
            for d in deltas:
                self._trackers[d.spec.name].advance(d)
            self._pending_defs.clear()
            self._pending_drops = []
            self._needs_full.clear()
            full_bytes = sum(t.spec.nbytes for t in self._trackers.values())
            self.last_stats = CheckpointStats(res.epoch, res.n_pages, res.payload_bytes, res.total_bytes, full_bytes,
                                              time.perf_counter() - t0, t1 - t0, t2 - t1, res.region_pages)
            self._appended_since_compact += res.total_bytes
            self._maybe_compact()
            return res.epoch

    # ---------------------------------------------------------------------------------------- restore
    def recover_into(self, targets: Mapping[str, Any] | None = None, *, keep_images: bool = True) -> Recovered:
        """Restore registered regions (or ``targets``: name -> buffer) from the last committed epoch.

        The log was verified when this Runtime opened it; that replay's copy pass runs now, straight into
        page-locked host memory for regions on a GPU (``RecoveryOptions.pinned``), so each such region goes
        to the device in one DMA. ``keep_images=False`` drops the host images of the regions restored here
        from the result (their bytes are in the buffers now; pinned memory goes back to the allocator)."""
        with self._mutex:
            t0 = time.perf_counter()
            res, self.log.replayed = self.log.replayed, None  # the open-time replay serves one restore
            if res is None or res.epoch != self.epoch:  # used already, or epochs were committed since
                if res is not None:
                    res.close()
                res = replay(self.log_dir, options=self.recovery.replay_options(), materialize=False)
            try:
                _check_epoch(res)
                names = self._restore_names(res.specs, targets)
                direct = not keep_images
                res.materialize({n: a for n in names if (a := self._image_alloc(n, direct)) is not None})
            finally:
                res.close()
            rec = _recovered(res, t0)
            t1 = time.perf_counter()
            for name in names:
                self._restore_one(name, rec.images[name], targets)
            rec.restore_s = time.perf_counter() - t1
            if not keep_images:
                rec.images = {n: img for n, img in rec.images.items() if n not in names}
            rec.seconds = time.perf_counter() - t0
            return rec

    def _restore_names(self, specs: Mapping[str, RegionSpec], targets: Mapping[str, Any] | None) -> list[str]:
        """The regions to restore, checked against the log before anything is copied."""
        names = list(targets) if targets is not None else [n for n in self._trackers if n in specs]
        for name in names:
            if name not in specs:
                raise RecoveryError(f"region {name!r} is not in the log (it has: {sorted(specs)})")
            spec = specs[name]
            if targets is not None and name not in self._trackers:
                nbytes = host_bytes(targets[name]).nbytes
                if nbytes != spec.nbytes:
                    raise RecoveryError(f"region {name!r}: target has {nbytes} bytes, log has {spec.nbytes}")
                continue
            tracker = self._trackers[name]
            if tracker.spec.nbytes != spec.nbytes or tracker.spec.page_bytes != spec.page_bytes:
                raise RecoveryError(
                    f"region {name!r}: registered as {tracker.spec.nbytes} bytes in {tracker.spec.page_bytes}-byte "
                    f"pages, the log holds {spec.nbytes} bytes in {spec.page_bytes}-byte pages; "
                    "register a buffer of the logged size")
        return names

    def _image_alloc(self, name: str, direct: bool) -> Callable[[int], Any] | None:
        """Where the replay writes a region restored into a registered buffer: page-locked host memory for a
        GPU buffer; with ``direct`` (no image is handed back), a host buffer's own bytes when the region is a
        whole number of pages, so the replay writes them in place and the restore has nothing to copy.
        None: zeroed numpy memory."""
        if name not in self._trackers:
            return None
        buf = self._buffers.get(name)
        if _is_torch(buf) and buf.is_cuda:
            return _pinned_or_pageable if self.recovery.pinned else None
        tracker = self._trackers[name]
        if not direct or not isinstance(tracker, CpuTracker) or tracker.spec.nbytes % tracker.spec.page_bytes:
            return None
        target = tracker.buf
        return lambda nbytes: target if nbytes == target.nbytes else np.empty(nbytes, dtype=np.uint8)

    def _restore_one(self, name: str, img: RegionImage, targets: Mapping[str, Any] | None) -> None:
        if targets is not None and name not in self._trackers:
            host_bytes(targets[name])[:] = img.data
            return
        tracker = self._trackers[name]
        pages = np.arange(img.spec.n_pages, dtype=np.int64)
        tracker.restore(pages, memoryview(img.padded).cast("B"))
        if tracker.spec == img.spec:
            self._needs_full.discard(name)
            self._pending_defs.pop(name, None)

    # -------------------------------------------------------------------------------------- compaction
    def compact(self, *, wait: bool = True) -> CompactionResult | None:
        """Rewrite base + sealed suffix into a new base. ``wait=False`` runs it in a background thread."""
        if wait:
            self._join_compactor()
            result = compact_with_writer(self.log)
            self.last_compaction = result
            self._appended_since_compact = 0
            return result
        self._start_compactor()
        return None

    def _maybe_compact(self) -> None:
        if self._compact_after is None or self._appended_since_compact < self._compact_after:
            return
        if self._background:
            self._start_compactor()
        else:
            self.compact()

    def _start_compactor(self) -> None:
        if self._compactor is not None and self._compactor.is_alive():
            return
        self._appended_since_compact = 0

        def run() -> None:
            try:
                self.last_compaction = compact_with_writer(self.log)
            except BaseException as e:  # noqa: BLE001 - reported, never lost: the old segments stay valid
                self.compaction_error = e
                log.error("background compaction of %s failed: %s (the log is unchanged)", self.log_dir, e)

        self._compactor = threading.Thread(target=run, name="concordia-compactor", daemon=True)
        self._compactor.start()

    def _join_compactor(self) -> None:
        if self._compactor is not None:
            self._compactor.join()
            self._compactor = None

    # ------------------------------------------------------------------------------------------ misc
    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """Suspend every resident GPU executor around work that would block behind it (module loads,
        first launches, device-wide sync, cudaFree): ``with rt.quiesced(): model = torch.compile(...)``.
        Without an executor (or without CUDA) this is a no-op."""
        guard = sys.modules.get("concordia_ft.cuda.guard")  # never imported: no executor can be resident
        if guard is None:
            yield
            return
        with guard.quiesced():
            yield

    def close(self) -> None:
        self._join_compactor()
        with self._mutex:
            for t in self._trackers.values():
                t.close()
            self.log.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
