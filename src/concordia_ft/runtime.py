"""Runtime: the region registry + a backend per region + the recovery log.

``checkpoint()`` collects every region's dirty pages, appends them (with the session metadata) as ONE
epoch, and returns only once that epoch is committed per the fsync policy; trackers advance only after the
commit, so a failed epoch is found again by the next one. ``recover()`` replays a log into host arrays in
any process; ``Runtime.recover_into()`` restores registered buffers (host or GPU) in place.

``checkpoint_async()`` takes the log write off the caller's critical path: on the calling thread it only
snapshots the epoch's pages in order after the caller's work (CUDA: device-side copies and an event, no host
synchronisation; host regions: a copy), then a background writer finishes the epoch (DtoH, append, commit,
advance). One epoch at most is in flight: the next checkpoint first waits for it (backpressure). The epoch is
NOT durable when ``checkpoint_async`` returns, only when its ``PendingEpoch.wait()`` returns (or the next
checkpoint / ``wait()`` / ``close()`` does): a crash loses at most that one in-flight epoch, never a committed
one. A failure in the background is raised by the next checkpoint, ``wait()`` or ``close()``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .core.compaction import CompactionResult, compact_with_writer
from .core.format import encode_json
from .core.log import LogOptions, OpenReport, RecoveryLog
from .core.options import coerce_options
from .core.regions import DiffMode, MemoryRange, RegionKind, RegionSpec, RegionTable, check_page_bytes
from .core.replay import Outcome, RegionImage, ReplayOptions, ReplayResult, ReplayTimings, TailInfo, replay
from .core.tracking import DenseBatch, RegionDelta, StagedBatch, StagedDelta, Tracker
from .cpu.trackers import CpuDenseBatch, CpuTracker
from .errors import CheckpointError, ConcordiaError, ConfigError, RecoveryError, RegionError

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
        return coerce_options(cls, value, "recovery")

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
    seconds: float  # from the call to the epoch committed and the trackers advanced
    detect_seconds: float  # sync: collect; async: stage on the caller + waiting for the snapshot and its DtoH
    append_seconds: float
    region_pages: dict[str, int] = field(default_factory=dict)
    mode: str = "sync"  # "sync" (checkpoint) or "async" (checkpoint_async)
    call_seconds: float = 0.0  # time the calling thread spent in checkpoint() / checkpoint_async()
    backpressure_seconds: float = 0.0  # part of call_seconds spent waiting for the previous async epoch
    commit_latency_seconds: float = 0.0  # from the call to the epoch committed (durable per the fsync policy)
    snapshot_device_bytes: int = 0  # device memory held for asynchronous snapshots, all regions

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


# -------------------------------------------------------------------------------------- async epochs
class _StagePlan:
    """How an asynchronous epoch stages the registry (built once per registry state): the dense regions of each
    backend (and device) as one ``DenseBatch``, every other region by its own tracker; immutable regions only
    until their full epoch has committed. Indices are registration order, the order of an epoch's regions."""

    def __init__(self, trackers: dict[str, Tracker]) -> None:
        host: list[CpuTracker] = []
        device: list[Any] = []
        self.singles: list[tuple[int, str, Tracker]] = []  # opaque and paged regions
        self.immutables: list[tuple[int, str, Tracker]] = []
        index: dict[str, int] = {}
        for i, (name, t) in enumerate(trackers.items()):
            index[name] = i
            if t.spec.kind is RegionKind.DENSE:
                (host if isinstance(t, CpuTracker) else device).append(t)
            elif t.spec.kind is RegionKind.IMMUTABLE:
                self.immutables.append((i, name, t))
            else:
                self.singles.append((i, name, t))
        batches: list[DenseBatch] = [CpuDenseBatch(host)] if host else []
        if device:
            from .cuda.trackers import batch_dense

            batches.extend(batch_dense(device))
        self.batches = [(tuple(index[sp.name] for sp in b.specs), tuple(sp.name for sp in b.specs), b)
                        for b in batches]
        # what holds device memory for snapshots (dense members hold none: their batch does)
        self.holders: list[Any] = [*batches, *(t for _, _, t in self.singles)]

    def close(self) -> None:
        for _, _, b in self.batches:
            b.close()


def _first(item: tuple[int, RegionDelta]) -> int:
    return item[0]


class PendingEpoch:
    """An epoch handed to the background writer by ``Runtime.checkpoint_async``.

    Not durable yet: ``wait()`` returns the epoch number once it is committed (per the fsync policy) or raises
    ``CheckpointError``. ``epoch`` is the number it gets if it commits; ``stats`` is set once it has."""

    def __init__(self, runtime: Runtime, log: RecoveryLog, epoch: int,
                 batches: list[tuple[tuple[int, ...], tuple[str, ...], StagedBatch]],
                 singles: list[tuple[int, str, StagedDelta]], *,
                 plan: _StagePlan, defs: list[RegionSpec], drops: list[str], full: set[str], meta: Any,
                 started: float, backpressure_seconds: float, full_bytes: int) -> None:
        self.epoch = epoch
        self.stats: CheckpointStats | None = None
        self.error: CheckpointError | None = None
        self.committed = False
        self._runtime = runtime
        self._log = log
        self._batches = batches
        self._singles = singles
        self._plan = plan
        self._defs, self._drops, self._full, self._meta = defs, drops, full, meta
        self._started = started
        self._backpressure = backpressure_seconds
        self._call_seconds = 0.0
        self._full_bytes = full_bytes
        self._finished = False  # committed or failed; then the latch is released (a latch, not an Event:
        self._latch = threading.Lock()  # this is built on the training thread once per step)
        self._latch.acquire()
        self._reaped = False

    @property
    def call_seconds(self) -> float:
        """How long ``checkpoint_async`` held the calling thread (backpressure included)."""
        return self._call_seconds

    @property
    def backpressure_seconds(self) -> float:
        """How long ``checkpoint_async`` waited for the previous epoch to finish (0 when it had)."""
        return self._backpressure

    def _region_names(self) -> list[str]:
        """The regions this epoch snapshotted."""
        return [n for _, names, _ in self._batches for n in names] + [n for _, n, _ in self._singles]

    def done(self) -> bool:
        """True once the epoch has committed or failed (``wait()`` then returns or raises at once)."""
        return self._finished

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the epoch is committed; return its number. Raises its ``CheckpointError`` if it failed
        (the runtime then does not raise that failure again), ``TimeoutError`` if ``timeout_s`` passed first."""
        if not self._await(timeout_s):
            raise TimeoutError(f"epoch {self.epoch} is not committed after {timeout_s} s (still in flight)")
        self._runtime._reap(self)
        if self.error is not None:
            self._runtime._forget_failure(self.error)
            raise self.error
        return self.epoch

    def __repr__(self) -> str:
        state = "failed" if self.error else "committed" if self.committed else "in flight"
        return f"PendingEpoch({self.epoch}, {state})"

    def _await(self, timeout_s: float | None = None) -> bool:
        """Block until the epoch has finished (or ``timeout_s`` passed); True when it has."""
        if self._finished:
            return True
        if self._latch.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            self._latch.release()  # the next waiter passes too
        return self._finished

    def _finish(self) -> None:
        self._finished = True
        self._latch.release()

    # ---- the background writer's part ----
    def _run(self) -> None:
        t0 = time.perf_counter()
        single_deltas: list[RegionDelta] = []
        try:
            ordered: list[tuple[int, RegionDelta]] = []
            for idx, _, sb in self._batches:
                ordered.extend(zip(idx, sb.results(), strict=True))
            for i, _, s in self._singles:
                d = s.result()
                single_deltas.append(d)
                ordered.append((i, d))
            ordered.sort(key=_first)  # registration order, as a synchronous epoch lays the regions out
            t1 = time.perf_counter()
            res = self._log.append(defs=self._defs, drops=self._drops, deltas=[d for _, d in ordered],
                                   meta=None if self._meta is None else self._meta.value)
            t2 = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's next call, never lost
            self._abandon()
            self._fail(e, committed=False)
            return
        self.epoch = res.epoch
        try:
            for _, _, sb in self._batches:
                sb.commit()
            for (_, _, s), d in zip(self._singles, single_deltas, strict=True):
                s.commit(d)
        except BaseException as e:  # noqa: BLE001
            self._fail(e, committed=True)
            return
        end = time.perf_counter()
        self.stats = CheckpointStats(
            res.epoch, res.n_pages, res.payload_bytes, res.total_bytes, self._full_bytes, end - self._started,
            (t1 - t0) + (self._call_seconds - self._backpressure), t2 - t1, res.region_pages, mode="async",
            call_seconds=self._call_seconds, backpressure_seconds=self._backpressure,
            commit_latency_seconds=t2 - self._started,
            snapshot_device_bytes=sum(h.snapshot_device_bytes for h in self._plan.holders))
        self.committed = True
        self._finish()

    def _abandon(self) -> None:
        for _, names, sb in self._batches:
            try:
                sb.abandon()
            except BaseException as e2:  # noqa: BLE001 - the first failure is the one to report
                log.error("giving back the snapshot of %s after epoch %d failed: %s", names, self.epoch, e2)
        for _, name, s in self._singles:
            try:
                s.abandon()
            except BaseException as e2:  # noqa: BLE001 - the first failure is the one to report
                log.error("giving back the snapshot of %r after epoch %d failed: %s", name, self.epoch, e2)

    def _fail(self, e: BaseException, *, committed: bool) -> None:
        last = self.epoch if committed else self._log.last_epoch
        err = CheckpointError(self.epoch, last, committed, f"{type(e).__name__}: {e}")
        err.__cause__ = e
        self.error, self.committed = err, committed
        log.error("%s", err)
        self._finish()


class _EpochWriter:
    """The one background thread that finishes a runtime's asynchronous epochs, in submission order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[PendingEpoch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: PendingEpoch) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job._run()
            del job  # hold nothing between epochs


_EXIT_DRAIN_S = 120.0
_with_writers: weakref.WeakSet[Runtime] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    """An interpreter exiting without close(): let an in-flight epoch finish (the writer thread is a daemon)."""
    for rt in list(_with_writers):
        job = rt._inflight
        if job is not None and not job._await(_EXIT_DRAIN_S):
            log.error("exiting with epoch %d of %s still in flight after %.0f s: it is lost (not committed)",
                      job.epoch, rt.log_dir, _EXIT_DRAIN_S)


@dataclass(frozen=True)
class _FrozenMeta:
    """An epoch's metadata as JSON text, taken on the caller's thread (the caller may change its dict next);
    the writer thread decodes it (``value``), off the training step's critical path."""

    text: bytes

    @property
    def value(self) -> Any:
        return json.loads(self.text)


@dataclass(frozen=True)
class _HandedMeta:
    """An epoch's metadata handed over by a caller that never changes it again (``copy_meta=False``): no copy,
    and the writer encodes it (once, in the log append)."""

    value: Any


def _frozen_meta(meta: Any, copy: bool = True) -> _FrozenMeta | _HandedMeta | None:
    """A private copy of an epoch's metadata, checked JSON-able now (or, ``copy=False``, the object itself)."""
    if meta is None:
        return None
    if not copy:
        return _HandedMeta(meta)
    try:
        return _FrozenMeta(encode_json(meta))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint metadata must be JSON-able: {e}") from None


# ------------------------------------------------------------------------------------------- runtime
class Runtime:
    """Registers regions, checkpoints them as committed epochs, and restores them."""

    def __init__(self, log_dir: str | Path, fsync: str = "always", *, backend: str = "file",
                 fsync_interval_ms: int = 100, page_bytes: int = 4096, segment_max_bytes: int = 1 << 30,
                 compact_after_bytes: int | None = 256 << 20, background_compaction: bool = True,
                 device_handlers: str = "auto", recovery: RecoveryOptions | Mapping[str, Any] | None = None,
                 log_options: Mapping[str, Any] | None = None) -> None:
        self.page_bytes = check_page_bytes(page_bytes)
        if device_handlers not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"device_handlers must be 'auto', 'cuda' or 'cpu', got {device_handlers!r}")
        self.device_handlers = device_handlers
        self.recovery = RecoveryOptions.coerce(recovery)
        self.log = RecoveryLog.open(log_dir, LogOptions(fsync=fsync, fsync_interval_ms=fsync_interval_ms,
                                                        backend=backend, segment_max_bytes=segment_max_bytes,
                                                        **dict(log_options or {})),
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
        self._writer: _EpochWriter | None = None  # started by the first checkpoint_async
        self._inflight: PendingEpoch | None = None  # submitted and not yet reaped
        self._unreported: CheckpointError | None = None  # a background failure no caller has seen yet
        self._closed = False
        self._mutable: list[tuple[str, Tracker]] | None = None  # trackers that are not immutable (cached)
        self._nbytes: int | None = None  # bytes of every tracked region (cached)
        self._plan: _StagePlan | None = None  # how checkpoint_async stages the registry (cached)
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
        is cleared with it, and its newer bytes wait for the block's next write. ``checkpoint_async()`` has
        no such window: it takes (reads and clears) the flags at the call, in stream order, so a block flagged
        after it returns belongs to the next epoch; if the epoch fails, the flags it took are set again.

        ``initially_zero`` (paged regions): the buffer is all zeros now (a fresh KV arena), so its first epoch
        logs only the flagged blocks instead of the whole region; recovery recreates the rest as zeros.
        Checked here (one pass over the buffer), since a wrong promise would lose data.
        """
        with self._mutex:
            self._drain(raise_failure=False)  # an in-flight epoch names the registry as it was
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
            self._registry_changed()
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

            tracker = make_cuda_tracker(spec, buf, dirty_blocks=dirty_blocks)
            if self.log.accepts_placed and spec.kind in (RegionKind.PAGED, RegionKind.DENSE):
                # payloads DMA'd straight into the log's mapped pages (core/mapped.py, cuda/mapped.py)
                from .cuda.mapped import register_host_range

                self.log.set_mapping_registrar(register_host_range)
                tracker.direct = True
            return tracker  # type: ignore[no-any-return]
        try:
            # a paged tracker's bitmap is its state: it needs no full first epoch unless the runtime asks
            return CpuTracker(spec, host_bytes(buf), _bitmap(dirty_blocks), synced=spec.kind is RegionKind.PAGED)
        except ValueError as e:
            raise RegionError(str(e)) from None

    def unregister(self, name: str) -> None:
        with self._mutex:
            self._drain(raise_failure=False)
            self._registry_changed()
            self.table.remove(name)
            self._buffers.pop(name, None)
            tracker = self._trackers.pop(name, None)
            if tracker is not None:
                tracker.close()
                if self._pending_defs.pop(name, None) is None:
                    self._pending_drops.append(name)
                self._needs_full.discard(name)

    def forget(self, name: str) -> None:
        """Drop a region that the log holds but this process does not register (a component whose layout
        changed, after it restored the old regions): the next epoch records the drop, and recovery of any later
        epoch no longer returns it. A name the log does not hold is dropped harmlessly."""
        with self._mutex:
            if name in self.table:
                raise RegionError(f"region {name!r} is registered; use unregister({name!r})")
            self._drain(raise_failure=False)
            if name not in self._pending_drops:
                self._pending_drops.append(name)

    def _registry_changed(self) -> None:
        """Drop what is cached about the registry (caller holds the mutex, no epoch in flight)."""
        self._mutable, self._nbytes = None, None
        if self._plan is not None:
            self._plan.close()
            self._plan = None

    # ------------------------------------------------------------------------------------- checkpoint
    def checkpoint(self, meta: Any = None) -> int:
        """Commit every region's dirty pages and ``meta`` (JSON-able) as one epoch; return its number.

        The epoch is committed (per the fsync policy) when this returns. An asynchronous epoch still in flight
        is finished first, and a background failure not yet raised is raised here."""
        with self._mutex:
            if self._closed:
                raise ConfigError(f"the runtime of {self.log_dir} is closed")
            t0 = time.perf_counter()
            self._drain()
            tb = time.perf_counter()
            deltas: list[RegionDelta] = []
            for name, tracker in self._epoch_trackers():
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
            took = time.perf_counter() - t0
            self.last_stats = CheckpointStats(res.epoch, res.n_pages, res.payload_bytes, res.total_bytes,
                                              self._full_bytes(), took, t1 - tb, t2 - t1, res.region_pages,
                                              call_seconds=took, backpressure_seconds=tb - t0,
                                              commit_latency_seconds=t2 - t0,
                                              snapshot_device_bytes=self._snapshot_bytes(deltas))
            self._appended_since_compact += res.total_bytes
            self._maybe_compact()
            return res.epoch

    def checkpoint_async(self, meta: Any = None, *, copy_meta: bool = True) -> PendingEpoch:
        """Start an epoch of every region's dirty pages and ``meta`` and return without waiting for the log.

        On the calling thread: wait for the previous asynchronous epoch if it is still in flight (backpressure:
        at most ONE epoch is ever pending; ``stats.backpressure_seconds`` says how long), raise its failure if
        it failed, then snapshot this epoch's pages. A CUDA region's snapshot is enqueued on torch's current
        stream, after the caller's work: detection and a gather (opaque, paged) into a device buffer, then an
        event; the dense regions of a device are ONE batch: D2D copies into one device buffer (regions adjacent
        in memory share a copy) and one event. No host synchronisation, so GPU work launched after this call
        returns may rewrite the regions at once. A host region's snapshot is a copy (dense host regions: one
        copy each into one reused staging buffer). A paged region's dirty flags are taken (cleared) now and
        flagged again if the epoch fails. ``meta`` is copied now (as JSON, so a value that is not JSON-able
        raises ``ConfigError`` here); ``copy_meta=False`` hands the object over instead, for a caller that builds
        a fresh one per call and never changes it afterwards (``LoraTrainer`` does): no copy on this thread, the
        writer encodes it, and a value that is not JSON-able fails the epoch in the background.

        On the background writer: wait for the snapshot, copy it DtoH into pinned memory, append and commit
        the epoch, then advance the trackers from exactly the committed bytes.

        Durability: NOT durable when this returns. Durable when the returned handle's ``wait()`` returns, or
        the next ``checkpoint`` / ``checkpoint_async`` / ``wait()`` / ``close()`` returns. A crash in between
        loses this epoch only (the loss window is one epoch); every epoch committed before stays intact, and
        recovery returns the last committed one.

        Failures in the background (log full, disk error, device error) are raised as ``CheckpointError`` by
        the next checkpoint, ``wait()`` or ``close()`` (or by the handle's ``wait()``, then not again); the
        regions' changes are logged again by the next epoch.

        Memory: the first asynchronous epoch allocates a device snapshot buffer the padded size of each mutable
        CUDA region (plus one byte per block for paged regions; immutable regions need none):
        ``snapshot_device_bytes`` reports it; and a host staging buffer the padded size of the dense host
        regions. Call ``wait()`` before ``recover_into()``.
        """
        with self._mutex:
            if self._closed:
                raise ConfigError(f"the runtime of {self.log_dir} is closed")
            t0 = time.perf_counter()
            self._drain()
            t1 = time.perf_counter()
            frozen = _frozen_meta(meta, copy_meta)
            plan = self._plan if self._plan is not None else self._build_plan()
            needs_full = self._needs_full
            batches: list[tuple[tuple[int, ...], tuple[str, ...], StagedBatch]] = []
            singles: list[tuple[int, str, StagedDelta]] = []
            try:
                for idx, names, batch in plan.batches:  # dense regions: every page, whatever ``full`` says
                    batches.append((idx, names, batch.stage()))
                for i, name, tracker in plan.singles:
                    singles.append((i, name, tracker.stage(full=name in needs_full)))
                if needs_full:  # an immutable region until its full epoch has committed
                    for i, name, tracker in plan.immutables:
                        if name in needs_full:
                            singles.append((i, name, tracker.stage(full=True)))
            except BaseException:
                for _, _, sb in batches:
                    sb.abandon()
                for _, _, s in singles:
                    s.abandon()
                raise
            job = PendingEpoch(self, self.log, (self.log.last_epoch or 0) + 1, batches, singles, plan=plan,
                               defs=list(self._pending_defs.values()), drops=list(self._pending_drops),
                               full=set(needs_full), meta=frozen, started=t0, backpressure_seconds=t1 - t0,
                               full_bytes=self._full_bytes())
            if self._writer is None:
                self._writer = _EpochWriter(f"concordia-epochs-{self.log_dir.name}")
                _with_writers.add(self)
            self._inflight = job
            job._call_seconds = time.perf_counter() - t0
            self._writer.submit(job)
            return job

    def wait(self) -> int | None:
        """Block until no asynchronous epoch is in flight; raise a background failure not raised yet; return
        the last committed epoch (None when the log holds none)."""
        with self._mutex:
            self._drain()
            return self.epoch

    @property
    def in_flight(self) -> PendingEpoch | None:
        """The asynchronous epoch submitted last, until a checkpoint or ``wait()`` has taken its outcome."""
        return self._inflight

    @property
    def snapshot_device_bytes(self) -> int:
        """Device memory held for asynchronous snapshots (allocated by the first async epoch)."""
        held = sum(t.snapshot_device_bytes for t in self._trackers.values())
        if self._plan is not None:
            held += sum(b.snapshot_device_bytes for _, _, b in self._plan.batches)
        return held

    def _snapshot_bytes(self, deltas: list[RegionDelta]) -> int:
        """snapshot_device_bytes, asking only the regions of an epoch (not hundreds of immutable weights)."""
        held = sum(self._trackers[d.spec.name].snapshot_device_bytes for d in deltas)
        if self._plan is not None:
            held += sum(b.snapshot_device_bytes for _, _, b in self._plan.batches)
        return held

    def _build_plan(self) -> _StagePlan:
        self._plan = _StagePlan(self._trackers)
        return self._plan

    def _epoch_trackers(self) -> list[tuple[str, Tracker]]:
        """The trackers an epoch asks for pages: an immutable region only until its full epoch committed (a
        model's weights registered immutable are hundreds of regions: not worth a call each per epoch)."""
        if self._needs_full:
            return [(n, t) for n, t in self._trackers.items()
                    if t.spec.kind is not RegionKind.IMMUTABLE or n in self._needs_full]
        if self._mutable is None:
            self._mutable = [(n, t) for n, t in self._trackers.items() if t.spec.kind is not RegionKind.IMMUTABLE]
        return self._mutable

    def _full_bytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = sum(t.spec.nbytes for t in self._trackers.values())
        return self._nbytes

    def _drain(self, *, raise_failure: bool = True) -> None:
        """Wait for the in-flight asynchronous epoch and take its outcome (caller holds the mutex)."""
        job = self._inflight
        if job is not None:
            job._await()
            self._reap(job)
        if raise_failure and self._unreported is not None:
            err, self._unreported = self._unreported, None
            raise err

    def _reap(self, job: PendingEpoch) -> None:
        """Apply a finished asynchronous epoch's outcome to the registry's bookkeeping, once."""
        with self._mutex:
            if job._reaped:
                return
            job._reaped = True
            if self._inflight is job:
                self._inflight = None
            if job.committed:
                for spec in job._defs:
                    self._pending_defs.pop(spec.name, None)
                self._pending_drops = [d for d in self._pending_drops if d not in job._drops]
                self._needs_full -= job._full
            if job.error is not None:
                if job.error.committed:  # the trackers' baselines are unknown: log everything next time
                    self._needs_full |= {n for n in job._region_names() if n in self._trackers}
                self._unreported = job.error
            if job.stats is not None:
                self.last_stats = job.stats
                self._appended_since_compact += job.stats.total_bytes
                self._maybe_compact()

    def _forget_failure(self, err: CheckpointError) -> None:
        with self._mutex:
            if self._unreported is err:
                self._unreported = None

    # ---------------------------------------------------------------------------------------- restore
    def recover_into(self, targets: Mapping[str, Any] | None = None, *, keep_images: bool = True) -> Recovered:
        """Restore registered regions (or ``targets``: name -> buffer) from the last committed epoch.

        The log was verified when this Runtime opened it; that replay's copy pass runs now, straight into
        page-locked host memory for regions on a GPU (``RecoveryOptions.pinned``), so each such region goes
        to the device in one DMA. ``keep_images=False`` drops the host images of the regions restored here
        from the result (their bytes are in the buffers now; pinned memory goes back to the allocator)."""
        with self._mutex:
            self._drain()  # an asynchronous epoch in flight commits (or fails) before the log is read
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
        """Finish the in-flight asynchronous epoch, close trackers and log; then raise a background failure
        that no call has raised yet."""
        try:
            with self._mutex:
                self._drain(raise_failure=False)
        finally:
            if self._writer is not None:
                self._writer.stop()
                self._writer = None
            self._join_compactor()
            with self._mutex:
                if self._plan is not None:
                    self._plan.close()
                for t in self._trackers.values():
                    t.close()
                self.log.close()
                self._closed = True
        err, self._unreported = self._unreported, None
        if err is not None:
            raise err

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
