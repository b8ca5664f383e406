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

The Runtime is split along its seams: ``buffers`` (numpy/torch buffer adapters), ``backends`` (one interface
per kind of memory: CPU reference trackers, CUDA handlers), ``checkpoint`` (stats and the asynchronous epoch
pipeline), ``recovery`` (``recover()``, ``Recovered``, restore planning). This module holds the registry.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .backends import Backend, backend_for, check_device_handlers
from .buffers import any_nonzero, describe_buffer, host_bytes
from .checkpoint import CheckpointStats, EpochWriter, PendingEpoch, StagePlan, drain_at_exit, freeze_meta
from .core.compaction import CompactionResult, compact_with_writer
from .core.log import LogOptions, OpenReport, RecoveryLog
from .core.oscalls import OsCalls
from .core.regions import DiffMode, RegionKind, RegionSpec, RegionTable, check_page_bytes
from .core.replay import RegionImage, replay
from .core.tracking import RegionDelta, StagedBatch, StagedDelta, Tracker
from .errors import (
    CheckpointError,
    CompactionError,
    CompactionWarning,
    ConfigError,
    LogCorruptError,
    RecoveryError,
    RegionError,
)
from .recovery import (
    Recovered,
    RecoveryOptions,
    check_epoch,
    plan_restore,
    recover,
    recovered,
)

__all__ = [  # the public names of this module (some live in the modules it is split into)
    "CheckpointStats", "PendingEpoch", "Recovered", "RecoveryOptions", "Runtime", "describe_buffer", "host_bytes",
    "open_to_recover", "recover",
]

log = logging.getLogger("concordia_ft.runtime")


# ------------------------------------------------------------------------------------------- runtime
# how each kind is logged, for the message that refuses a diff mode on it
_KIND_LOGGING = {RegionKind.DENSE: "whole every epoch", RegionKind.PAGED: "by its dirty_blocks flags",
                 RegionKind.IMMUTABLE: "once", RegionKind.SCRATCH: "never"}


class Runtime:
    """Registers regions, checkpoints them as committed epochs, and restores them.

    ``log_io``: the OS calls the log writer makes (core/oscalls.py); tests pass one that injects faults."""

    def __init__(self, log_dir: str | Path, fsync: str = "always", *, backend: str = "file",
                 fsync_interval_ms: int = 100, page_bytes: int = 4096, segment_max_bytes: int = 1 << 30,
                 compact_after_bytes: int | None = 256 << 20, background_compaction: bool = True,
                 device_handlers: str = "auto", recovery: RecoveryOptions | Mapping[str, Any] | None = None,
                 log_io: OsCalls | None = None, log_options: Mapping[str, Any] | None = None,
                 on_compaction_error: str = "raise") -> None:
        if on_compaction_error not in ("raise", "warn"):
            raise ConfigError(f"on_compaction_error={on_compaction_error!r}: use 'raise' (the next checkpoint "
                              "raises CompactionError once, writing nothing) or 'warn' (a CompactionWarning, and "
                              "the checkpoint goes on)")
        self.on_compaction_error = on_compaction_error
        self.page_bytes = check_page_bytes(page_bytes)
        self.device_handlers = check_device_handlers(device_handlers)
        self.recovery = RecoveryOptions.coerce(recovery)
        self.log = RecoveryLog.open(log_dir, LogOptions(fsync=fsync, fsync_interval_ms=fsync_interval_ms,
                                                        backend=backend, segment_max_bytes=segment_max_bytes,
                                                        **dict(log_options or {})),
                                    replay_options=self.recovery.replay_options(), io=log_io)
        self.log_dir = Path(log_dir)
        self.table = RegionTable()
        self._trackers: dict[str, Tracker] = {}
        self._backends: dict[str, Backend] = {}  # the backend of each tracked region
        self._buffers: dict[str, Any] = {}
        self._pending_defs: dict[str, RegionSpec] = {}
        self._pending_drops: list[str] = []
        self._needs_full: set[str] = set()
        self._mutex = threading.RLock()
        self._compact_after = compact_after_bytes
        self._background = background_compaction
        # the suffix since the base ON DISK (earlier processes' epochs included), so that restarts add up
        self._appended_since_compact = self.log.replayed.suffix_bytes if self.log.replayed is not None else 0
        self._compactor: threading.Thread | None = None
        self.last_compaction: CompactionResult | None = None
        # every compaction of this runtime: count, seconds (seal included), seal seconds, bytes before / after
        self._compaction_live: Any = None  # set_compaction_live
        self._compactions = {"count": 0, "seconds": 0.0, "seal_wait_s": 0.0, "bytes_before": 0, "bytes_after": 0}
        self.compaction_error: CompactionError | None = None  # the last compaction failure (kept)
        self._compaction_unreported: CompactionError | None = None  # raised by the next checkpoint, once
        self.last_stats: CheckpointStats | None = None
        self._writer: EpochWriter | None = None  # started by the first checkpoint_async
        self._inflight: PendingEpoch | None = None  # submitted and not yet reaped
        self._unreported: CheckpointError | None = None  # a background failure no caller has seen yet
        self._closed = False
        self._mutable: list[tuple[str, Tracker]] | None = None  # trackers that are not immutable (cached)
        self._nbytes: int | None = None  # bytes of every tracked region (cached)
        self._plan: StagePlan | None = None  # how checkpoint_async stages the registry (cached)
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
            if self._closed:
                raise ConfigError(f"register({name!r}): the runtime of {self.log_dir} is closed; open a new "
                                  "Runtime on the log to register regions")
            self._drain(raise_failure=False)  # an in-flight epoch names the registry as it was
            kind = RegionKind.parse(kind)
            if diff is not None and kind is not RegionKind.OPAQUE:
                raise RegionError(f"region {name!r}: diff={str(getattr(diff, 'value', diff))!r} applies to opaque "
                                  f"regions only; a {kind.value} region is logged "
                                  f"{_KIND_LOGGING.get(kind, 'without a diff')}: drop diff=")
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
                if any_nonzero(buf):
                    raise RegionError(f"region {name!r} was registered with initially_zero=True but holds nonzero "
                                      "bytes; register it before writing to it, or drop initially_zero")
            backend = backend_for(name, where, self.device_handlers)
            tracker = None if kind is RegionKind.SCRATCH else backend.make_tracker(spec, buf, dirty_blocks)
            if tracker is not None:
                backend.attach_log(tracker, self.log)
            self.table.add(spec, where)
            self._buffers[name] = buf
            self._registry_changed()
            if tracker is not None:
                self._trackers[name] = tracker
                self._backends[name] = backend
                self._pending_defs[name] = spec
                if not initially_zero:
                    self._needs_full.add(name)
                if name in self._pending_drops:
                    self._pending_drops.remove(name)
            return spec

    def unregister(self, name: str) -> None:
        with self._mutex:
            self._drain(raise_failure=False)
            self._registry_changed()
            self.table.remove(name)
            self._buffers.pop(name, None)
            tracker = self._trackers.pop(name, None)
            self._backends.pop(name, None)
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
            self._raise_compaction_failure()
            self._check_deferred()
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
            self._raise_compaction_failure()
            self._check_deferred()
            t1 = time.perf_counter()
            frozen = freeze_meta(meta, copy_meta)
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
            job = PendingEpoch(self.log, (self.log.last_epoch or 0) + 1, batches, singles, plan=plan,
                               defs=self._pending_defs.values(), drops=self._pending_drops, full=needs_full,
                               meta=frozen, started=t0, backpressure_seconds=t1 - t0,
                               full_bytes=self._full_bytes(), settle=self._settle)
            if self._writer is None:
                self._writer = EpochWriter(f"concordia-epochs-{self.log_dir.name}")
                drain_at_exit(self)
            self._inflight = job
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
        return held + (self._plan.snapshot_device_bytes if self._plan is not None else 0)

    def _snapshot_bytes(self, deltas: list[RegionDelta]) -> int:
        """snapshot_device_bytes, asking only the regions of an epoch (not hundreds of immutable weights)."""
        held = sum(self._trackers[d.spec.name].snapshot_device_bytes for d in deltas)
        return held + (self._plan.snapshot_device_bytes if self._plan is not None else 0)

    def _build_plan(self) -> StagePlan:
        self._plan = StagePlan((n, t, self._backends[n]) for n, t in self._trackers.items())
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
            job.join()
            self._settle(job)
        if raise_failure and self._unreported is not None:
            err, self._unreported = self._unreported, None
            raise err

    def _settle(self, job: PendingEpoch, *, raised_to_caller: bool = False) -> None:
        """Apply a finished asynchronous epoch's outcome to the registry's bookkeeping, once. A failure is kept
        for the next call to raise, unless it has been raised to the caller (``PendingEpoch.wait``)."""
        with self._mutex:
            if job.claim():
                if self._inflight is job:
                    self._inflight = None
                c = job.contents
                if job.committed:
                    for spec in c.defs:
                        self._pending_defs.pop(spec.name, None)
                    self._pending_drops = [d for d in self._pending_drops if d not in c.drops]
                    self._needs_full -= c.full
                if job.error is not None:
                    if job.error.committed:  # the trackers' baselines are unknown: log everything next time
                        self._needs_full |= {n for n in c.regions if n in self._trackers}
                    self._unreported = job.error
                if job.stats is not None:
                    self.last_stats = job.stats
                    self._appended_since_compact += job.stats.total_bytes
                    self._maybe_compact()
            if raised_to_caller and job.error is not None and self._unreported is job.error:
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
            streamed: dict[str, Any] = {}
            try:
                check_epoch(res)
                names = plan_restore(res.specs, {n: t.spec for n, t in self._trackers.items()}, targets)
                direct = not keep_images
                sinks = self._stream_sinks(names, res) if direct and targets is None else {}
                allocs = {n: a for n in names if n not in sinks and (a := self._image_alloc(n, direct)) is not None}
                if sinks:
                    assert res.pending is not None
                    plans = {}
                    for n, sink in sinks.items():
                        tp = time.perf_counter()
                        plans[n] = res.pending.streamed_plan(n, sink.slot_bytes)
                        sink.plan_s = time.perf_counter() - tp
                    res.pending.check_deferred()  # the other regions' deferred checks, before their images
                    res.regions = res.pending.materialize(allocs, res.timings, skip=set(sinks))
                    populated = res.pending.populate_stats()  # how far the open's populate threads got
                    streamed = self._stream_restore(sinks, plans, res.pending)
                    for stats in streamed.values():
                        stats.extra.update({f"open_{k}": v for k, v in populated.items()})
                else:
                    res.materialize(allocs)  # runs any deferred checks first
            finally:
                res.close()
            rec = recovered(res, t0)
            rec.streamed = streamed
            t1 = time.perf_counter()
            for name in names:
                if name not in streamed:
                    self._restore_one(name, rec.images[name], targets)
            rec.restore_s = time.perf_counter() - t1
            if not keep_images:
                rec.images = {n: img for n, img in rec.images.items() if n not in names}
            rec.seconds = time.perf_counter() - t0
            return rec

    def _check_deferred(self) -> None:
        """Checksums the open left to a restore (RecoveryOptions.defer_verify) run before anything is appended
        after those epochs, restored or not (LogCorruptError if one fails)."""
        res = self.log.replayed
        if res is not None and res.pending is not None and res.pending.deferred:
            res.pending.check_deferred()

    def _stream_sinks(self, names: list[str], res: Any) -> dict[str, Any]:
        """The regions restored straight from the mapped segments (their backend's sink), the rest by image."""
        opts = self.recovery
        if not opts.streamed or res.pending is None:
            return {}
        sinks = {}
        for n in names:
            tracker = self._trackers.get(n)
            if tracker is None or tracker.spec != res.specs.get(n):
                continue
            t0 = time.perf_counter()
            sink = self._backends[n].stream_sink(tracker, slots=opts.ring_slots, slot_bytes=opts.slot_bytes,
                                                 verify=opts.stream_verify)
            if sink is not None:
                sink.setup_s = time.perf_counter() - t0  # the ring's allocation (pinned + device)
                sinks[n] = sink
        return sinks

    def _nontemporal(self) -> bool:
        """RecoveryOptions.nontemporal resolved: None is on where the C extension is built."""
        from .core.streamed import stream_copy_available

        nt = self.recovery.nontemporal
        return stream_copy_available() if nt is None else nt

    def _mirror(self, pending: Any) -> tuple[Any, Any, str]:
        """RecoveryOptions.mirror resolved for this restore: (translate, view, why not)."""
        m = self.recovery.mirror
        if not m:
            return None, None, ""
        from .cuda.mirror import MirrorAttach

        att = MirrorAttach(self.log_dir) if m is True else m
        view = att.result()
        if view is None:
            return None, None, att.why or "no segment of this log is mirrored"
        return view.translator(pending.mapped_segments()), view, ""

    def _stream_restore(self, sinks: dict[str, Any], plans: dict[str, Any], pending: Any) -> dict[str, Any]:
        """Stream each region's newest committed pages into its buffer; checksums deferred from the open
        (RecoveryOptions.defer_verify) are run on the way, and a failure raises before this returns. With a
        pinned mirror (RecoveryOptions.mirror) the chunks it holds are DMA'd from it; if a checksum then fails,
        the region is streamed again from the log alone (the mirror is a copy, the log is the record)."""
        from .core.streamed import run_streamed

        out = {}
        opts = self.recovery

        def stream(plan: Any, sink: Any, translate: Any) -> Any:
            try:
                return run_streamed(plan, sink, threads=opts.threads, prefault=opts.prefault,
                                    nontemporal=self._nontemporal(), mirror=translate)
            finally:
                close = getattr(sink, "close", None)
                if close is not None:
                    close()

        translate, view, why = self._mirror(pending) if sinks else (None, None, "")
        try:
            for name, sink in sinks.items():
                plan = plans[name]
                plan_s = float(getattr(sink, "plan_s", 0.0))
                try:
                    stats = stream(plan, sink, translate)
                except LogCorruptError as e:
                    if translate is None:
                        raise
                    log.warning("restore of %r: a payload taken from the pinned log mirror failed its checksum "
                                "(%s); streaming it again from the log alone", name, e)
                    sink = self._backends[name].stream_sink(self._trackers[name], slots=opts.ring_slots,
                                                            slot_bytes=opts.slot_bytes, verify=opts.stream_verify)
                    stats = stream(plan, sink, None)
                    stats.extra["mirror_fallback"] = 1.0
                stats.plan_s = plan_s
                stats.seconds += plan_s
                stats.extra["sink_setup_s"] = float(getattr(sink, "setup_s", 0.0))
                if view is not None:
                    stats.extra.update(mirror_attach_s=view.attach_s, mirror_segments=float(len(view.segments)),
                                       mirror_held_bytes=float(view.bytes))
                elif why:
                    stats.extra["mirror_unused"] = why  # type: ignore[assignment]
                out[name] = stats
                tracker = self._trackers[name]
                tracker.initialised = True  # type: ignore[attr-defined]  # the whole region holds committed bytes
                self._needs_full.discard(name)
                self._pending_defs.pop(name, None)
        finally:
            if view is not None:
                view.close()  # every DMA from it ran: each sink synchronized in its close
        return out

    def _image_alloc(self, name: str, direct: bool) -> Any:
        """Where the replay writes a region restored into a registered buffer (the region's backend decides);
        None: zeroed numpy memory."""
        if name not in self._trackers:
            return None
        return self._backends[name].image_alloc(self._trackers[name], direct=direct, pinned=self.recovery.pinned)

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
        self._check_deferred()
        if wait:
            self._join_compactor()
            self._compaction_unreported = None  # this call reports for itself
            try:
                result = compact_with_writer(self.log, live=self._compaction_live)
            except Exception as e:
                raise self._compaction_failed(e) from e
            self._compacted(result)
            self._appended_since_compact = 0
            return result
        self._start_compactor()
        return None

    def _compacted(self, result: CompactionResult) -> None:
        self.last_compaction = result
        if result.compacted:
            c = self._compactions
            c["count"] += 1
            c["seconds"] += result.seconds
            c["seal_wait_s"] += result.seal_seconds
            c["bytes_before"] += result.bytes_before
            c["bytes_after"] += result.bytes_after

    @property
    def compact_after_bytes(self) -> int | None:
        """Bytes appended (since the last compaction) that start the next one; None: never."""
        return self._compact_after

    @compact_after_bytes.setter
    def compact_after_bytes(self, nbytes: int | None) -> None:
        if nbytes is not None and nbytes <= 0:
            raise ConfigError(f"compact_after_bytes={nbytes}: a positive number of bytes, or None (never)")
        self._compact_after = nbytes

    def wait_compaction(self) -> None:
        """Until a background compaction running now has finished (its numbers are then in
        ``compaction_stats``); a failure is reported as ``on_compaction_error`` says, by the next checkpoint."""
        self._join_compactor()

    def set_compaction_live(self, live: Any) -> None:
        """``live(meta)`` -> {region name: the pages (ascending int64 array) the state of the epoch whose
        metadata is ``meta`` still needs} (or None): compactions leave the other pages of those regions out of
        the base (they replay as zeros). A pure function of the metadata: it runs on the compactor's thread, on
        the compacted epoch's metadata, not on the caller's current state."""
        self._compaction_live = live

    def compaction_stats(self) -> dict[str, float]:
        """The compactions this runtime ran: ``count``, ``seconds`` (sum, the seal included), ``seal_wait_s`` (of
        it, sealing the active segment), ``bytes_before`` / ``bytes_after`` (sums: the segments replaced, the
        bases written)."""
        return dict(self._compactions)

    @property
    def compacting(self) -> bool:
        """A background compaction is running."""
        c = self._compactor
        return c is not None and c.is_alive()

    def _compaction_failed(self, e: BaseException) -> CompactionError:
        err = e if isinstance(e, CompactionError) else CompactionError(str(self.log_dir), f"{type(e).__name__}: {e}")
        self.compaction_error = err
        return err

    def _raise_compaction_failure(self) -> None:
        """Report a compaction failure that no call has reported yet, once: raised (nothing was written) or, with
        ``on_compaction_error="warn"``, a CompactionWarning and the caller goes on."""
        err, self._compaction_unreported = self._compaction_unreported, None
        if err is None:
            return
        if self.on_compaction_error == "warn":
            warnings.warn(str(err), CompactionWarning, stacklevel=3)
            return
        raise err

    def leasable(self, *, ignore_in_flight: bool = False) -> bool:
        """True when the next epoch may be appended by a lessee of the log's tail (core/slotlog.py) instead of
        ``checkpoint``: no region definition, drop or full epoch pending, no failure to report, nobody waiting
        for a lease to end (a compaction's seal), and (unless ``ignore_in_flight``) no asynchronous epoch in
        flight. A lessee's epochs hold only the pages it was given: the trackers' flags are its caller's to
        clear."""
        return self.lease_blocker(ignore_in_flight=ignore_in_flight) is None

    def lease_blocker(self, *, ignore_in_flight: bool = False) -> str | None:
        """Why the next epoch may not be appended by a lessee (``leasable``'s conditions, the first that holds,
        as a word), or None."""
        with self._mutex:
            for why, holds in (("closed", self._closed), ("region_defs", self._pending_defs),
                               ("region_drops", self._pending_drops), ("full_epoch", self._needs_full),
                               ("async_in_flight", self._inflight is not None and not ignore_in_flight),
                               ("unreported_failure", self._unreported is not None),
                               ("compaction_failure", self._compaction_unreported is not None),
                               ("compaction_seal", self.log.lease_wanted), ("log_failed", self.log.failed is not None)):
                if holds:
                    return why
            return None

    def count_appended(self, nbytes: int, epochs: int) -> None:
        """Report ``epochs`` epochs of ``nbytes`` that another writer appended to this runtime's log (a leased
        tail: graph decode's or the engine's token-epoch writer): they count toward ``compact_after_bytes``
        like the runtime's own, and may start a compaction now."""
        if epochs > 0:
            self._appended_since_compact += int(nbytes)
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        if self._compact_after is None or self._appended_since_compact < self._compact_after:
            return
        if self._background:
            self._start_compactor()
        else:
            try:
                self.compact()
            except CompactionError as e:  # this epoch committed: the next checkpoint reports the failure
                self._compaction_unreported = e

    def _start_compactor(self) -> None:
        if self._compactor is not None and self._compactor.is_alive():
            return
        self._appended_since_compact = 0

        def run() -> None:
            try:
                self._compacted(compact_with_writer(self.log, live=self._compaction_live))
            except BaseException as e:  # noqa: BLE001 - reported, never lost: the old segments stay valid
                self._compaction_unreported = self._compaction_failed(e)
                log.error("background compaction of %s failed: %s (the log is unchanged)", self.log_dir, e)

        self._compactor = threading.Thread(target=run, name="concordia-compactor", daemon=True)
        self._compactor.start()

    def _join_compactor(self) -> None:
        if self._compactor is not None:
            self._compactor.join()
            self._compactor = None

    # ------------------------------------------------------------------------------------------ misc
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
                self._closed = True
                self.log.close()  # raises CheckpointError if its final sync fails
        err, self._unreported = self._unreported, None
        if err is not None:
            raise err
        self._raise_compaction_failure()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_to_recover(log_dir: str | Path, key: str, what: str, *, fsync: str = "never", backend: str = "file",
                    runtime_options: dict[str, Any] | None = None) -> tuple[Runtime, Any]:
    """Open an existing log for a component that restores itself from it (a Session, a LoRA trainer).

    Returns the Runtime (which has replayed and verified the log once) and the ``key`` section of the last
    committed epoch's metadata. The caller registers its buffers and calls ``recover_into()``; it must close
    the Runtime if it gives up."""
    if not Path(log_dir).is_dir():
        raise RecoveryError(f"no log at {log_dir}: the directory does not exist")
    # a component goes on through a failed compaction (a CompactionWarning), as its constructor does
    rt = Runtime(str(log_dir), fsync=fsync, backend=backend, **{"on_compaction_error": "warn", **(runtime_options or {})})
    section = (rt.opened_meta or {}).get(key) if isinstance(rt.opened_meta, dict) else None
    if section is None:
        epoch = rt.epoch
        rt.close()
        raise RecoveryError(f"the last epoch ({epoch}) in {log_dir} holds no {what} metadata; was this log "
                            f"written by {what}?" if epoch is not None else f"{log_dir} holds no committed epoch")
    return rt, section
