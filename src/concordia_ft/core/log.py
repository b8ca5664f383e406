"""The recovery log writer: one committed epoch per ``append``, Redis-AOF style.

A log directory holds ``MANIFEST`` (which segments, in order), ``LOCK`` (held by the one writer or
compactor), an optional base segment (one full epoch) and incremental segments. ``RecoveryLog.open``
replays what is there, cuts a torn tail (and says so), removes orphans left by a crash, and appends after
the last committed epoch.

fsync policies and their loss windows (what a power failure or kernel crash can take; a killed *process*
loses nothing that ``append`` returned under any policy, since the bytes are in the page cache):

- ``always``: fdatasync before ``append`` returns: nothing that returned is lost.
- ``interval``: a background thread syncs every ``fsync_interval_ms``: at most that many ms of epochs.
- ``never``: the kernel's writeback decides (dirty_expire_centisecs, 30 s by default).

When an OS call fails (every one goes through ``oscalls.OsCalls``), ``append`` raises ``CheckpointError``: the
failed epoch's bytes are cut back and its number stays free, or, where what the disk holds is no longer known
(a failed sync of returned epochs, a failed cut, a failed directory fsync), the log is failed and appends
nothing more until it is reopened. DESIGN.md, "When a write or a sync fails", has the rule for each call.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointError, ConfigError, LogCorruptError, LogError, LogLockedError
from .checksums import crc32c_buffers, crc32c_parallel, native_available
from .epochs import RecordCache, assemble_epoch, layout_epoch, plan_epoch
from .format import SEGMENT_BASE, SEGMENT_HEADER_BYTES, SEGMENT_INCR, SegmentHeader
from .manifest import SEGMENT_RE, DirSyncError, Manifest, fsync_dir, store_manifest
from .mapped import MappedSegment, Registrar, SparePreparer
from .options import coerce_options
from .oscalls import REAL_OS, OsCalls
from .regions import RegionSpec
from .replay import Outcome, ReplayOptions, ReplayResult, replay
from .segment import DaxSegment, FileSegment, SegmentWriter, check_backend
from .tracking import RegionDelta

log = logging.getLogger("concordia_ft.log")

FSYNC_POLICIES = ("always", "interval", "never")
LEASE_FSYNC = {"never": 0, "always": 1, "interval": 2}  # TailLease.fsync: the C writer's FSYNC_* (core/_slotlog.c)
# the failure kinds a lessee reports to ``end_lease`` (the C writer's ERR_*)
LEASE_ERR_SLOT, LEASE_ERR_WRITE, LEASE_ERR_SYNC = 1, 2, 3
LOCK_NAME = "LOCK"


@dataclass
class LogOptions:
    fsync: str = "always"
    fsync_interval_ms: int = 100
    backend: str = "file"
    segment_max_bytes: int = 1 << 30
    dax_segment_bytes: int = 1 << 30
    # dram backend: segments are preallocated tmpfs files mapped MAP_SHARED (core/mapped.py), so payloads can
    # be placed (DMA'd) into the log's own pages; "auto" = on for dram. Capacity per segment (an epoch larger
    # than that gets a segment of its own size).
    mapped: str = "auto"
    mapped_segment_bytes: int = 64 << 20
    # a mapped log whose large epochs recur (LoRA: 53 MB each, every one rolls) prepares its next segments to
    # hold this many of them (at most 4 x mapped_segment_bytes), so most epochs do not roll; 0: never grow
    mapped_fit_epochs: int = 4

    def __post_init__(self) -> None:
        if self.mapped not in ("auto", "on", "off"):
            raise ConfigError(f"mapped={self.mapped!r}; use 'auto', 'on' or 'off'")
        if self.mapped == "on" and self.backend != "dram":
            raise ConfigError(f"mapped='on' needs backend 'dram' (tmpfs); the backend is {self.backend!r}")
        if self.mapped_fit_epochs < 0:
            raise ConfigError(f"mapped_fit_epochs must be 0 or more, got {self.mapped_fit_epochs}")
        if self.mapped_segment_bytes < 1 << 20:
            raise ConfigError(f"mapped_segment_bytes must be at least 1 MiB, got {self.mapped_segment_bytes}")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"unknown fsync policy {self.fsync!r}; use one of {', '.join(FSYNC_POLICIES)}")
        if self.fsync_interval_ms <= 0:
            raise ConfigError(f"fsync_interval_ms must be positive, got {self.fsync_interval_ms}")
        if self.segment_max_bytes < 1 << 20:
            raise ConfigError(f"segment_max_bytes must be at least 1 MiB, got {self.segment_max_bytes}")

    @classmethod
    def coerce(cls, value: LogOptions | Mapping[str, Any] | None) -> LogOptions:
        return coerce_options(cls, value, "log")

    @property
    def uses_mapped(self) -> bool:
        return self.backend == "dram" and self.mapped != "off"


@dataclass(frozen=True)
class TailLease:
    """The active segment as an external appender sees it (``RecoveryLog.lease_tail``): where to store, from
    which offset, the limits that make the log roll, the epoch number that comes next and the fsync policy
    (``LEASE_FSYNC``; the interval in ns)."""

    kind: str  # "mapped" (store into the mapping at ``address``) or "file" (pwritev on ``fd``)
    address: int
    fd: int
    end: int
    capacity: int
    soft_max: int  # segment_max_bytes: a segment that holds an epoch already rolls before passing it
    segment_epochs: int
    next_epoch: int
    fsync: int  # LEASE_FSYNC
    interval_ns: int
    synced_end: int
    durable_epoch: int  # -1: none


@dataclass
class AppendResult:
    epoch: int
    segment: str
    offset: int
    total_bytes: int
    payload_bytes: int
    n_pages: int
    region_pages: dict[str, int] = field(default_factory=dict)


@dataclass
class OpenReport:
    """What ``RecoveryLog.open`` found and did, for the caller to show."""

    created: bool
    outcome: Outcome
    last_epoch: int | None
    cut_bytes: int = 0
    cut_reason: str = ""
    removed_orphans: list[str] = field(default_factory=list)
    durable: bool = True


class DirLock:
    """An exclusive flock on ``DIR/LOCK``; released when the process dies, so a SIGKILL never wedges it."""

    def __init__(self, log_dir: Path, what: str) -> None:
        self.path = log_dir / LOCK_NAME
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LogError(
                f"cannot write to the log directory {log_dir} ({e.strerror}): a {what} needs a directory it can "
                "write; fix its permissions or mount, or pick another directory. To read a log on read-only "
                "media, use concordia_ft.recover(DIR) or `concordia log inspect DIR`"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise LogLockedError(
                f"{log_dir} is in use by another writer or compactor; only one {what} may hold a log. "
                "Close the other Runtime (or wait for `concordia log compact` to finish)"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def _open_segment(path: Path, opts: LogOptions, io: OsCalls, *, header: bytes | None = None,
                  end: int | None = None, capacity: int = 0, register: Registrar | None = None) -> SegmentWriter:
    if opts.backend == "dax":
        return DaxSegment(path, opts.dax_segment_bytes, create_with=header, end=end, io=io)
    if opts.uses_mapped:
        cap = max(capacity, min(opts.mapped_segment_bytes, opts.segment_max_bytes))
        return MappedSegment(path, cap, create_with=header, end=end, register=register, io=io)
    return FileSegment(path, create_with=header, io=io)


def _preallocated(seg: SegmentWriter) -> bool:
    """The segment's file is longer than its epochs (zeros after): torn bytes are zeroed, not cut off."""
    return isinstance(seg, (DaxSegment, MappedSegment))


class PlacedPayload(Protocol):
    """A payload that is not in host memory yet (a device buffer): ``place(address)`` starts copying its
    ``nbytes`` bytes to that host address (a mapped segment's pages), ``wait()`` returns once they are there."""

    nbytes: int

    def place(self, address: int) -> None: ...

    def wait(self) -> None: ...


def _add_incr_segment(log_dir: Path, manifest: Manifest, opts: LogOptions, io: OsCalls, *, capacity: int = 0,
                      register: Registrar | None = None, spare: SparePreparer | None = None,
                      stats: dict[str, Any] | None = None) -> SegmentWriter:
    """Create the next incremental segment (header synced), then name it in the manifest (atomically).

    On a failure before the manifest's rename, ``manifest`` names the same segments as before and the new file
    is removed (or left as an orphan the next open deletes). ``DirSyncError``: the manifest on disk names the
    new segment, so ``manifest`` does too and the segment is not removed; its durability is unknown."""
    new = manifest.copy()
    name = new.new_segment_name("incr")
    manifest.next_generation = new.next_generation  # a name is handed out once, even when this fails
    header = segment_header(new, name)
    seg: SegmentWriter | None = None
    if spare is not None and opts.uses_mapped:  # created, faulted in and registered ahead, off this path
        seg = spare.take(log_dir / name, header, capacity)
    if stats is not None:
        stats["prepared" if seg is not None else "on_the_spot"] += 1
    if seg is None:
        seg = _open_segment(log_dir / name, opts, io, header=header, capacity=capacity, register=register)
    new.incr.append(name)
    try:
        store_manifest(log_dir, new, io=io)
    except DirSyncError:
        manifest.incr = new.incr
        seg.close(quietly=True)
        raise
    except BaseException:
        seg.close(quietly=True)
        io.unlink_quietly(seg.path)
        raise
    manifest.incr = new.incr
    return seg


def _describe(e: BaseException) -> str:
    """An OS error as a message says it (errno name, text, the file), with a hint when the disk is full."""
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        where = f" ({Path(e.filename).name})" if e.filename else ""
        hint = "; the disk is full: free space or move the log" if e.errno == errno.ENOSPC else ""
        return f"[{name}] {e.strerror or os.strerror(e.errno)}{where}{hint}"
    return f"{type(e).__name__}: {e}"


class _WriteFailed(Exception):
    """Internal: a step of an append failed; ``text`` says what and what it means (the log may be failed)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def remove_orphans(log_dir: Path, manifest: Manifest) -> list[str]:
    """Delete segment files the manifest does not name and leftover temp files (both crash debris)."""
    keep = set(manifest.segments())
    removed = []
    for p in sorted(log_dir.iterdir()):
        if (SEGMENT_RE.match(p.name) and p.name not in keep) or p.name.endswith(".tmp"):
            p.unlink()
            removed.append(p.name)
    if removed:
        fsync_dir(log_dir)
    return removed


def make_log_dir(path: Path) -> Path | None:
    """Create the log directory (and missing parents); return the topmost directory this call created (None:
    it existed). Raises ConfigError when ``path`` (or a parent) is a file, LogError when it cannot be created."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file, not a log directory; pass a directory (it is created if missing)")
    top = None
    p = path
    while not p.exists() and p != p.parent:
        top, p = p, p.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"cannot create the log directory {path}: {p} is a file, not a directory") from None
    except OSError as e:
        raise LogError(f"cannot create the log directory {path} ({e.strerror}); pick a directory you can write, "
                       "or fix the permissions or mount of its parent") from None
    return top


def remove_created_dir(path: Path, top: Path | None) -> None:
    """Undo :func:`make_log_dir` after a refused open: remove the directories it created, if they hold
    nothing but the lock file this open made (never anything else)."""
    if top is None:
        return
    try:
        if {p.name for p in path.iterdir()} <= {LOCK_NAME}:
            (path / LOCK_NAME).unlink(missing_ok=True)
        p = path
        while True:
            p.rmdir()
            if p == top:
                break
            p = p.parent
    except OSError:
        pass  # not empty (something else was written meanwhile) or already gone: leave it


class RecoveryLog:
    """The single writer of a log directory. Thread-safe: the compactor runs beside the appender."""

    def __init__(self, log_dir: Path, opts: LogOptions, lock: DirLock, manifest: Manifest,
                 segment: SegmentWriter, last_epoch: int | None, report: OpenReport,
                 replayed: ReplayResult | None, io: OsCalls = REAL_OS) -> None:
        self.dir = log_dir
        self._io = io
        self.options = opts
        self._lock = lock
        self.manifest = manifest
        self._segment = segment
        self.last_epoch = last_epoch
        self.report = report
        # what open() replayed and verified, its copy pass deferred (the mapped segments stay open): the Runtime
        # restores from it without a second pass, into memory it picks per region; released by close()
        self.replayed = replayed
        self._mutex = threading.RLock()
        self._dirty = False
        self._closed = False
        self._segment_epochs = 0
        # durability bookkeeping (DESIGN.md, "When a write or a sync fails"): the active segment's bytes before
        # _synced_end are on stable storage, and so is every epoch up to _durable_epoch
        self._synced_end = segment.end
        self._durable_epoch = last_epoch
        self._failure: str | None = None  # set once: why this writer appends nothing more
        self._failure_epoch = 0  # the first epoch whose fate the failure leaves unknown
        self._failure_reported = False
        self._syncer: threading.Thread | None = None
        self._stop = threading.Event()
        self._register: Registrar | None = None  # pins mapped segments with the driver (set by the CUDA layer)
        self._spare: SparePreparer | None = None
        self._crc_pool: Any = None
        # the phases of the last placed append (seconds): roll, place (DMA issued), wait (DMA done), crc, write
        self._phases: dict[str, float] = {}
        self._timed: list[Any] = []  # the last placed epoch's payloads whose copy time the GPU measured
        self._record_cache: RecordCache = {}  # page records of dense regions (placed epochs of a registered log)
        # the active segment handed to an external appender (core/slotlog.py: graph decode's C writer); while
        # leased, append() refuses, the interval syncer leaves the segment to the lessee, a compactor's seal waits
        self._leased = False
        self._lease_waiters = 0  # threads waiting for the lease to end (a compaction's seal)
        self._lease_done = threading.Condition(self._mutex)
        # a compactor that wants the active segment sealed while a lessee that can roll holds it (``seal_wanted``):
        # the lessee rolls at its next epoch (roll_leased), instead of ending its lease
        self._seal_waiters = 0
        self._rollable_lease = False
        # segment rolls of this writer: how many, how many took a segment prepared ahead / made one on the spot,
        # the seconds they took on the thread that rolled
        self.roll_stats: dict[str, Any] = {"rolls": 0, "prepared": 0, "on_the_spot": 0, "seconds": 0.0}
        if opts.fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="concordia-fsync", daemon=True)
            self._syncer.start()

    # ------------------------------------------------------------------------------------------ opening
    @classmethod
    def open(cls, log_dir: str | os.PathLike[str], options: LogOptions | dict[str, Any] | None = None, *,
             replay_options: ReplayOptions | dict[str, Any] | None = None, io: OsCalls | None = None
             ) -> RecoveryLog:
        """Open (or create) the log for appending. The replay this takes verifies every epoch; its copy
        pass is deferred to whoever restores (``self.replayed``). ``io``: the OS calls the writer makes (tests
        pass a fault-injecting table; default the real ones)."""
        opts = LogOptions.coerce(options)
        path = Path(log_dir)
        check_backend(opts.backend, path)  # refused before anything is created
        created = make_log_dir(path)
        try:
            lock = DirLock(path, "writer")
        except BaseException:
            remove_created_dir(path, created)
            raise
        result: ReplayResult | None = None
        try:
            result = replay(path, options=replay_options, materialize=False)
            return cls._open_locked(path, opts, lock, result, io or REAL_OS)
        except BaseException:
            if result is not None:
                result.close()
            lock.release()
            remove_created_dir(path, created)
            raise

    @classmethod
    def _open_locked(cls, path: Path, opts: LogOptions, lock: DirLock, result: ReplayResult, io: OsCalls
                     ) -> RecoveryLog:
        if result.manifest is None:
            # a first open killed before its manifest was stored leaves a segment with no epoch (replay checked
            # that every one here is such): remove them, the new log starts at generation 1 again
            for p in sorted(path.glob("*.cft")):
                io.unlink_quietly(p)
            manifest = Manifest(log_id=secrets.token_bytes(16).hex())
            seg = _add_incr_segment(path, manifest, opts, io)
            report = OpenReport(True, Outcome.EMPTY, None, durable=seg.durable)
            return cls(path, opts, lock, manifest, seg, None, report, result, io)
        manifest = result.manifest
        report = OpenReport(False, result.outcome, result.epoch)
        if result.outcome is Outcome.DAMAGED_TAIL:
            assert result.tail is not None
            raise LogCorruptError(
                str(path / result.tail.segment), result.tail.offset, result.tail.reason,
                "the last epoch is whole but fails its checksum (media damage or a lost write), so the "
                "writer will not append after it. Run `concordia log check DIR --fix` to cut it "
                f"(epoch after {result.epoch} is lost), then reopen",
            )
        report.removed_orphans = remove_orphans(path, manifest)
        if not manifest.incr:  # only a base (after an offline compaction): appends go to a new segment
            seg = _add_incr_segment(path, manifest, opts, io)
            report.durable = seg.durable
            return cls(path, opts, lock, manifest, seg, result.epoch, report, result, io)
        last = manifest.segments()[-1]
        end = result.end_offset if result.end_segment == last else None
        if end is None:  # the tail segment never got its header: start it again
            (path / last).unlink(missing_ok=True)
            seg = _open_segment(path / last, opts, io, header=segment_header(manifest, last))
        else:
            seg = _open_segment(path / last, opts, io, end=end)
            size = os.path.getsize(path / last)
            if result.tail is not None or (not _preallocated(seg) and size > end):
                reason = result.tail.reason if result.tail else "trailing zero bytes"
                if isinstance(seg, (DaxSegment, MappedSegment)):  # preallocated: clear the torn bytes
                    written_end = result.tail.written_end if result.tail else end
                    report.cut_bytes = written_end - end
                    seg.cut(end, written_end)
                else:
                    report.cut_bytes = size - end
                    seg.cut(end)
                report.cut_reason = reason
                log.warning("cut %d bytes of torn tail from %s at offset %d (%s): that epoch never committed",
                            report.cut_bytes, last, end, reason)
            elif opts.fsync != "never":  # what an earlier writer left is made durable before anything follows it
                try:
                    seg.sync()
                except OSError as e:
                    seg.close(quietly=True)
                    raise LogError(f"syncing {path / last} before appending to it failed: {_describe(e)}; the "
                                   "device is failing or full: fix that, then open the log again") from e
        report.durable = seg.durable
        return cls(path, opts, lock, manifest, seg, result.epoch, report, result, io)

    # ------------------------------------------------------------------------------------------ writing
    def append(self, *, defs: Sequence[RegionSpec] = (), drops: Sequence[str] = (),
               deltas: Sequence[RegionDelta] = (), meta: Any = None, epoch: int | None = None) -> AppendResult:
        """Write one epoch and commit it per the fsync policy. Returns once committed.

        Raises ``CheckpointError`` when an OS call under it fails (DESIGN.md, "When a write or a sync fails"):
        ``log_failed`` False: the epoch's bytes were taken back, its number is free and the log goes on (call
        again once the cause is fixed); True: this writer appends nothing more, reopen the log."""
        with self._mutex:
            self._check_open()
            number = (self.last_epoch or 0) + 1 if epoch is None else epoch
            if self.last_epoch is not None and number != self.last_epoch + 1:
                raise ConfigError(f"epoch {number} does not follow the last committed epoch {self.last_epoch}")
            self._check_not_failed(number)
            if self._leased:
                raise ConfigError(f"the log {self.dir} is being appended by graph decode's token-epoch writer; "
                                  "append after that generate() returned")
            # a payload that is still on a device (cuda.mapped.DevicePayload): DMA'd into the log's own pages
            placed = {i: d.payload for i, d in enumerate(deltas) if hasattr(d.payload, "place")}
            try:
                if placed:
                    plan, offset = self._placed_append(number, list(defs), list(drops), list(deltas),
                                                       placed, meta)  # type: ignore[arg-type]
                else:
                    plan = plan_epoch(number, self._segment.end, defs=list(defs), drops=list(drops),
                                      deltas=list(deltas), meta=meta)
                    seg = self._segment
                    if (self._segment_epochs and seg.end + plan.total_bytes > self.options.segment_max_bytes) or (
                            isinstance(seg, MappedSegment) and plan.total_bytes > seg.room()):
                        self._roll(plan.total_bytes)
                        plan = plan_epoch(number, self._segment.end, defs=list(defs), drops=list(drops),
                                          deltas=list(deltas), meta=meta)
                    offset = self._write_epoch(number, plan.parts)
            except _WriteFailed as f:
                raise self._error(number, f.text) from f.__cause__
            self.last_epoch = number
            self._segment_epochs += 1
            spare = self._spare
            if spare is not None and isinstance(self._segment, MappedSegment):
                spare.after_epoch(plan.total_bytes)  # the next spare, sized from the epochs seen
            return AppendResult(number, self._segment.path.name, offset, plan.total_bytes, plan.payload_bytes,
                                plan.n_pages, plan.region_pages)

    def _write_epoch(self, number: int, parts: Sequence[Any], placed: Sequence[int] = ()) -> int:
        """One vectored write (+ fdatasync under ``always``). On a failure the epoch's bytes are cut back (and
        the cut synced) so the number stays free; if the cut fails too, the log is failed."""
        seg = self._segment
        start = seg.end
        step = f"writing epoch {number} to {seg.path.name} at offset {start}"
        try:
            if placed:  # the payloads at these indices are in the mapping already (core/mapped.py)
                assert isinstance(seg, MappedSegment)
                seg.append_placed(parts, placed)
            else:
                seg.append(parts)
            if self.options.fsync == "always":
                step = f"{'msync' if isinstance(seg, DaxSegment) else 'fdatasync'} of epoch {number} in {seg.path.name}"
                seg.sync()
        except LogError as e:  # it does not fit (DAX): nothing was stored
            raise _WriteFailed(f"{step} failed: {e}") from e
        except OSError as e:
            cause = f"{step} failed: {_describe(e)}"
            try:
                if isinstance(seg, MappedSegment):  # zero what was placed or stored past the end
                    seg.cut(start, start + sum(memoryview(p).nbytes for p in parts))
                else:
                    seg.cut(start)
            except OSError as e2:
                raise _WriteFailed(self._mark_failed(
                    number, f"{cause}, and cutting its bytes back to offset {start} failed too ({_describe(e2)}); "
                    f"whether epoch {number} reached the disk is unknown")) from e
            self._synced_end = start  # the cut's fsync made everything before it durable
            self._durable_epoch = self.last_epoch
            raise _WriteFailed(f"{cause}; its bytes were cut back to offset {start}") from e
        if self.options.fsync == "always":
            self._synced_end = seg.end
            self._durable_epoch = number
        else:
            self._dirty = True
        return start

    def _roll(self, need: int = 0) -> None:
        """Seal the active incremental segment and continue in a new one (manifest updated atomically). A
        registered segment is retired (unregistered, unmapped) by the spare's worker, after the epoch.

        A failure before the manifest's rename leaves the log on the old segment, healthy; a failed fdatasync
        of the old segment or of the directory after the rename fails the log."""
        old = self._segment
        t0 = time.perf_counter()
        self._sync_active(f"fdatasync of {old.path.name} before sealing it")
        try:
            # an epoch is planned again at the new offset: its alignment padding can grow by up to a page
            seg = _add_incr_segment(self.dir, self.manifest, self.options, self._io,
                                    capacity=need + 2 * SEGMENT_HEADER_BYTES, register=self._register,
                                    spare=self._spare, stats=self.roll_stats)
        except DirSyncError as e:
            raise _WriteFailed(self._mark_failed((self.last_epoch or 0) + 1, (
                f"starting segment {self.manifest.incr[-1]}: the manifest naming it is in place, but fsyncing the "
                f"directory after it failed ({_describe(e)}), so whether it survives a crash is unknown"))) from e
        except OSError as e:
            raise _WriteFailed(f"starting a new segment after {old.path.name} failed: {_describe(e)}; the log goes "
                               f"on in {old.path.name}, unchanged") from e
        self._segment = seg
        self._segment_epochs = 0
        self._synced_end = seg.end
        self.roll_stats["rolls"] += 1
        self.roll_stats["seconds"] += time.perf_counter() - t0
        if self._seal_waiters:
            self._lease_done.notify_all()  # a compactor waiting for this seal
        if self._spare is not None and isinstance(old, MappedSegment):
            self._spare.retire(old)  # the worker retires it after this epoch and prepares the next spare
            return
        try:
            old.close()
        except OSError as e:  # synced already: nothing of it is at stake
            log.warning("closing sealed segment %s failed: %s", old.path, _describe(e))

    # ------------------------------------------------------------------------------- placed payloads
    @property
    def accepts_placed(self) -> bool:
        """True when payloads can be DMA'd into the log's own pages (a mapped segment)."""
        return isinstance(self._segment, MappedSegment)

    def set_mapping_registrar(self, register: Registrar, *, prepare_spare: bool = True) -> None:
        """Pin every mapped segment of this log with ``register(address, nbytes)`` (the CUDA layer's
        cuMemHostRegister), the active one now and each later one before it is used; with ``prepare_spare`` the
        next segment is created, faulted in and registered ahead, on a background thread."""
        with self._mutex:
            self._check_open()
            if not isinstance(self._segment, MappedSegment) or self._register is not None:
                return
            self._register = register
            self._segment.register(register)
            if self._spare is not None:  # prepared ahead already (prepare_spares): pinned from now on
                self._spare.set_registrar(register)
            elif prepare_spare:
                o = self.options
                cap = min(o.mapped_segment_bytes, o.segment_max_bytes)
                self._spare = SparePreparer(
                    self.dir, cap, register, io=self._io, fit_epochs=o.mapped_fit_epochs,
                    max_capacity=min(4 * o.mapped_segment_bytes, max(o.segment_max_bytes, o.mapped_segment_bytes)),
                    header_bytes=SEGMENT_HEADER_BYTES)
                self._spare.start()

    @property
    def registers_segments(self) -> bool:
        """The mapped segments are pinned with a driver (``set_mapping_registrar``): a device DMAs into them."""
        return self._register is not None

    def prepare_spares(self, depth: int = 1) -> bool:
        """Keep ``depth`` next segments of a mapped log prepared ahead (created, preallocated, faulted in, and
        pinned once ``set_mapping_registrar`` gave a registrar) by one background worker, so no roll makes its
        segment on the appending thread. False when the log's segments are not mapped."""
        with self._mutex:
            self._check_open()
            if not isinstance(self._segment, MappedSegment):
                return False
            if self._spare is None:
                o = self.options
                self._spare = SparePreparer(
                    self.dir, min(o.mapped_segment_bytes, o.segment_max_bytes), self._register, io=self._io,
                    fit_epochs=o.mapped_fit_epochs,
                    max_capacity=min(4 * o.mapped_segment_bytes, max(o.segment_max_bytes, o.mapped_segment_bytes)),
                    header_bytes=SEGMENT_HEADER_BYTES)
            self._spare.set_depth(depth)
            self._spare.start()
            return True

    def wait_spare(self, timeout_s: float | None = None) -> bool:
        """Until the next segment being prepared ahead (``set_mapping_registrar``) is ready, at most
        ``timeout_s``; True when one is ready, False when none is (no spare preparer: not a mapped log, or
        nothing registered it; a failed preparation: the roll then makes its segment itself)."""
        spare = self._spare
        return spare.wait_ready(timeout_s) if spare is not None else False

    def _placed_append(self, number: int, defs: list[RegionSpec], drops: list[str], deltas: list[RegionDelta],
                       placed: dict[int, PlacedPayload], meta: Any) -> tuple[Any, int]:
        """One epoch whose payloads ``placed`` (index into ``deltas`` -> device payload) are DMA'd straight into
        the mapped segment at their final offsets; CRCs from the placed bytes; header, then commit marker."""
        return self._placed_append_now(number, defs, drops, deltas, placed, meta)

    @property
    def last_placed_phases(self) -> dict[str, float]:
        """The phases of the last placed append (seconds): roll (lay out, + roll to the next segment), place
        (DMA issued), wait (until the payloads are there: ``crc_wait`` the CRC of the gated chunks as they land,
        then ``sync`` the streams), crc (what is left of the CRC + the head), write (header + commit marker);
        ``dma``: the copies themselves on the GPU (events, read here, off the append path); rolled, gated,
        registered: 0/1."""
        if self._timed:
            timed, self._timed = self._timed, []
            self._phases["dma"] = sum(float(p.copy_seconds()) for p in timed)
        return self._phases

    def _placed_append_now(self, number: int, defs: list[RegionSpec], drops: list[str], deltas: list[RegionDelta],
                           placed: dict[int, PlacedPayload], meta: Any) -> tuple[Any, int]:
        perf = time.perf_counter
        t0 = perf()
        rolled = 0.0
        spare = self._spare
        ahead = spare is not None  # a registered mapped log: its worker prepares segments ahead
        with_pages = [i for i, d in enumerate(deltas) if len(d.pages)]
        pages_of = [(deltas[i].spec, deltas[i].pages) for i in with_pages]
        cache = self._record_cache if ahead else None

        def lay_out(start: int) -> Any:
            if ahead:  # once: the offsets now, the head from the CRCs later (assemble_epoch)
                return layout_epoch(number, start, defs=defs, drops=drops, pages_of=pages_of, meta=meta,
                                    record_cache=cache)
            return plan_epoch(number, start, defs=defs, drops=drops, deltas=deltas, meta=meta,
                              payload_crcs=[0] * len(deltas))

        plan = lay_out(self._segment.end)
        seg = self._segment
        if not isinstance(seg, MappedSegment) or plan.total_bytes > seg.room():
            self._roll(plan.total_bytes)
            rolled = 1.0
            seg = self._segment
            if not isinstance(seg, MappedSegment):
                raise ConfigError("placed payloads need a mapped segment (backend 'dram', mapped on)")
            plan = lay_out(seg.end)
        start = seg.end
        offsets = list(plan.payload_offsets)
        views: list[RegionDelta] = list(deltas)
        quiet = spare.quiet if spare is not None and ahead else None  # driver (un)registration waits for the DMA
        t1 = perf()
        timed: list[Any] = []
        try:
            if quiet is not None:
                quiet.acquire()
            try:
                for k, i in enumerate(with_pages):
                    p = placed.get(i)
                    if p is not None:
                        p.place(seg.address + start + offsets[k])
                t2 = perf()
                for k, i in enumerate(with_pages):
                    p = placed.get(i)
                    if p is not None:
                        d = deltas[i]
                        views[i] = RegionDelta(d.spec, d.pages, seg.view(start + offsets[k], p.nbytes),
                                               d.scanned_bytes)
                # payloads whose DMA lands in gated chunks are checksummed while it is in flight (core/_slotlog.c)
                crcs = self._gated_crcs([views[i].payload for i in with_pages], [placed.get(i) for i in with_pages])
                gated = crcs is not None
                tc = perf()
                for i in with_pages:
                    p = placed.get(i)
                    if p is not None:
                        p.wait()
                        if hasattr(p, "copy_seconds"):
                            timed.append(p)
            finally:
                if quiet is not None:
                    quiet.release()
            t3 = perf()
            if crcs is None:
                crcs = self._placed_crcs([views[i].payload for i in with_pages])
            if ahead:
                plan = assemble_epoch(plan, [views[i] for i in with_pages], crcs)
            else:
                plan = plan_epoch(number, start, defs=defs, drops=drops, deltas=views, meta=meta, payload_crcs=crcs)
            t4 = perf()
        except BaseException:
            seg.cut(start, start + plan.total_bytes)  # nothing of this epoch stays behind
            raise
        in_place = [plan.payload_parts[k] for k, i in enumerate(with_pages) if i in placed]
        offset = self._write_epoch(number, plan.parts, in_place)
        self._phases = {"roll": t1 - t0, "place": t2 - t1, "wait": t3 - t2, "crc_wait": tc - t2, "sync": t3 - tc,
                        "crc": t4 - t3, "write": perf() - t4, "dma": 0.0, "rolled": rolled,
                        "gated": 1.0 if gated else 0.0, "registered": 1.0 if seg.registered else 0.0}
        for stale in self._timed:  # never read: their events go back to the pool unread
            drop = getattr(stale, "drop_timing", None)
            if drop is not None:
                drop()
        self._timed = timed
        return plan, offset

    def _gated_crcs(self, views: list[Any], payloads: list[Any]) -> list[int] | None:
        """CRC32C of the placed payloads as their DMA lands, when every one of them announces its chunks
        (``gates``: cuda.mapped.DevicePayload, large copies) and the C checksum is on; else None."""
        if not payloads:
            return None
        gates: list[tuple[int, int, int, int]] = []
        addr = 0
        for b, p in enumerate(payloads):
            if p is None:
                continue  # a host payload in the same epoch: its bytes are there already
            g = getattr(p, "gates", None)
            if not g:
                return None
            if addr and p.flags_address != addr:
                return None
            addr = p.flags_address
            gates.extend((b, end, word, tag) for end, word, tag in g)
        if not gates:
            return None
        if not native_available():
            return None
        return crc32c_buffers(views, threads=min(8, os.cpu_count() or 1), flags_address=addr, gates=gates)

    def _placed_crcs(self, payloads: list[Any]) -> list[int]:
        """CRC32C of each placed payload: in C with the GIL released once where the extension is built, else the
        crc32c package on a pool (one task per piece)."""
        if native_available():
            out = crc32c_buffers(payloads, threads=min(8, os.cpu_count() or 1))
            assert out is not None  # no gates: it never gives up
            return out
        pool = self._crc_workers()
        return [crc32c_parallel(p, pool) for p in payloads]

    def _crc_workers(self) -> Any:
        if self._crc_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._crc_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                thread_name_prefix="concordia-crc")
        return self._crc_pool

    def _sync_active(self, step: str) -> None:
        """fdatasync the active segment if it holds bytes not known durable (caller holds the mutex). A failure
        fails the log: after a failed fsync the page cache no longer says what the disk holds."""
        seg = self._segment
        end = seg.end
        if self._synced_end >= end:
            self._dirty = False
            return
        try:
            seg.sync()
        except OSError as e:
            first = (self._durable_epoch or 0) + 1
            raise _WriteFailed(self._mark_failed(first, (
                f"{step} failed: {_describe(e)}; epochs {first} to {self.last_epoch} were written but may not "
                "be on disk"))) from e
        self._synced_end = end
        self._durable_epoch = self.last_epoch
        self._dirty = False

    def _mark_failed(self, first_unknown: int, text: str) -> str:
        """Fail the log (once): this writer appends nothing more; a reopen replays what the disk holds."""
        if self._failure is None:
            self._failure, self._failure_epoch = text, first_unknown
            log.error("the recovery log %s is failed: %s; reopen it to go on", self.dir, text)
        return self._failure

    def _error(self, number: int, text: str) -> CheckpointError:
        failed = self._failure is not None
        if failed:
            self._failure_reported = True
        last = self._durable_epoch if failed else self.last_epoch
        return CheckpointError(number if not failed else min(number, self._failure_epoch), last, False, text,
                               failed)

    def _check_not_failed(self, number: int) -> None:
        if self._failure is not None:
            raise self._error(number, self._failure)

    @property
    def seal_wanted(self) -> bool:
        """A compactor waits for a rollable lessee to roll (``lease_tail(rollable=True)``)."""
        return self._seal_waiters > 0

    @property
    def lease_wanted(self) -> bool:
        """True while a thread waits for the lease to end (a compaction sealing the active segment): a lessee
        that can pause (the serving engine's step epochs) ends its lease and takes none until this is False."""
        return self._lease_waiters > 0

    @property
    def failed(self) -> str | None:
        """Why this writer appends nothing more (None while it is healthy)."""
        return self._failure

    def sync(self) -> None:
        """Make every appended epoch durable. Raises ``CheckpointError`` (``log_failed``) if that fails."""
        with self._mutex:
            if self._closed:
                return
            self._check_not_failed((self.last_epoch or 0) + 1)
            try:
                self._sync_active(f"fdatasync of {self._segment.path.name}")
            except _WriteFailed as f:
                raise self._error((self.last_epoch or 0) + 1, f.text) from f.__cause__

    def _sync_loop(self) -> None:
        period = self.options.fsync_interval_ms / 1000
        while not self._stop.wait(period):
            with self._mutex:
                if self._closed or self._failure is not None:
                    return
                if not self._dirty or self._leased:  # a lessee syncs its own appends (core/slotlog.py)
                    continue
                try:
                    self._sync_active(f"background fdatasync of {self._segment.path.name}")
                except _WriteFailed:  # failed now: the next append, sync or close raises it
                    return


    # ------------------------------------------------------------------------------- leased tail
    def lease_tail(self, *, rollable: bool = False) -> TailLease | None:
        """Hand the active segment to an external appender (core/slotlog.py) until ``end_lease``: None when
        this log cannot be leased (a DAX segment, OS calls that are not the real ones, a failed log).
        ``rollable``: the lessee watches ``seal_wanted`` and rolls (``roll_leased``) before its next epoch, so a
        compactor's seal waits for that roll instead of for the lease's end."""
        with self._mutex:
            self._check_open()
            if self._failure is not None or self._leased or self._io is not REAL_OS:
                return None
            lease = self._tail_lease()
            if lease is not None:
                self._leased = True
                self._rollable_lease = rollable
            return lease

    def _tail_lease(self) -> TailLease | None:
        seg = self._segment
        if isinstance(seg, MappedSegment):
            kind, address, fd, cap = "mapped", seg.address, -1, seg.capacity
        elif type(seg) is FileSegment:
            kind, address, fd, cap = "file", 0, seg.fileno(), 1 << 62
        else:
            return None
        return TailLease(kind, address, fd, seg.end, cap, self.options.segment_max_bytes, self._segment_epochs,
                         (self.last_epoch or 0) + 1, LEASE_FSYNC[self.options.fsync],
                         self.options.fsync_interval_ms * 1_000_000, self._synced_end,
                         -1 if self._durable_epoch is None else self._durable_epoch)

    def _apply_lessee(self, st: Mapping[str, Any]) -> None:
        """Take over what the lessee appended (its ``state()``): the tail, the epoch count, what is durable."""
        seg = self._segment
        n = int(st["next_epoch"]) - 1
        if n > (self.last_epoch or 0):
            self.last_epoch = n
        seg.end = int(st["end"])
        self._segment_epochs = int(st["segment_epochs"])
        self._synced_end = int(st["synced_end"])
        d = int(st["durable_epoch"])
        self._durable_epoch = None if d < 0 else d
        self._dirty = self._synced_end < seg.end

    def roll_leased(self, st: Mapping[str, Any], need: int) -> TailLease:
        """The lessee's next epoch (``need`` bytes) does not fit: seal the segment, start the next one, lease it.
        Raises ``CheckpointError`` (the lease is then over) when that fails."""
        with self._mutex:
            self._apply_lessee(st)
            try:
                self._roll(need)
            except _WriteFailed as f:
                self._end_lease_locked()
                raise self._error((self.last_epoch or 0) + 1, f.text) from f.__cause__
            if self._spare is not None:
                self._spare.took(need)  # no after_epoch follows a lessee's epochs: the next spare is made now
            lease = self._tail_lease()
            if lease is None or lease.capacity - lease.end < need:
                self._end_lease_locked()
                raise self._error((self.last_epoch or 0) + 1, f"the new segment has no room for an epoch of {need} "
                                  "bytes")
            return lease

    def end_lease(self, st: Mapping[str, Any], error: tuple[int, int, str, int, int] | None = None
                  ) -> CheckpointError | None:
        """The lessee is done (``st``: its final ``state()``); ``error``: its failure (kind, errno, text, the
        failed epoch's start, its number), returned as the CheckpointError a failed append would raise."""
        with self._mutex:
            self._apply_lessee(st)
            err = None
            if error is not None:
                err = self._lessee_failure(*error)
            self._end_lease_locked()
            return err

    def _end_lease_locked(self) -> None:
        self._leased = False
        self._rollable_lease = False
        self._lease_done.notify_all()

    def _lessee_failure(self, kind: int, errnum: int, text: str, start: int, number: int) -> CheckpointError:
        cause = f"{text} failed: {_describe(OSError(errnum, os.strerror(errnum)))}" if errnum else text
        seg = self._segment
        if kind == LEASE_ERR_WRITE and not isinstance(seg, MappedSegment):  # as _write_epoch: cut the epoch's
            try:  # bytes back; its number stays free (into a mapping the C writer fails only before it stores)
                seg.cut(start)
            except OSError as e2:
                return self._error(number, self._mark_failed(number, (
                    f"{cause}, and cutting its bytes back to offset {start} failed too ({_describe(e2)}); whether "
                    f"epoch {number} reached the disk is unknown")))
            self._synced_end = start
            self._durable_epoch = self.last_epoch
            return self._error(number, f"{cause}; its bytes were cut back to offset {start}")
        if kind == LEASE_ERR_SYNC:  # a failed sync of returned epochs: what the disk holds is unknown
            first = (self._durable_epoch or 0) + 1
            return self._error(number, self._mark_failed(first, (
                f"{cause}; epochs {first} to {self.last_epoch} were written but may not be on disk")))
        return self._error(number, f"{cause}; nothing of epoch {number} was written")

    # ------------------------------------------------------------------------------------ compaction
    def seal_for_compaction(self) -> list[str]:
        """Start a new incremental segment; return the sealed segments a compactor may rewrite."""
        with self._mutex:
            self._check_open()
            if self._leased and self._rollable_lease:
                # the lessee (the serving engine's step epochs) rolls before its next epoch; the segments before
                # the one it then appends to are sealed. An idle lessee ends its lease instead (below).
                rolls = self.roll_stats["rolls"]
                self._seal_waiters += 1
                try:
                    while (self._leased and self._rollable_lease and self.roll_stats["rolls"] == rolls
                           and not self._closed and self._failure is None):
                        self._lease_done.wait()
                finally:
                    self._seal_waiters -= 1
                self._check_open()
                if self._failure is not None:
                    raise LogError(f"the log {self.dir} is failed ({self._failure}); compaction waits for a reopen")
                if self.roll_stats["rolls"] != rolls:
                    return self.manifest.segments()[:-1]
            while self._leased:  # graph decode appends to the active segment: seal it once that is over
                self._lease_waiters += 1
                try:
                    self._lease_done.wait()
                finally:
                    self._lease_waiters -= 1
            self._check_open()
            if self._failure is not None:
                raise LogError(f"the log {self.dir} is failed ({self._failure}); compaction waits for a reopen")
            if self._segment_epochs:
                try:
                    self._roll()
                except _WriteFailed as f:
                    raise LogError(f"sealing the active segment for compaction failed: {f.text}") from f.__cause__
            return self.manifest.segments()[:-1]

    @property
    def io(self) -> OsCalls:
        """The OS boundary this writer's calls go through (a compactor writing beside it uses it too)."""
        return self._io

    def reserve_base(self) -> tuple[str, bytes]:
        """The name and segment header of the next base segment a compactor writes."""
        with self._mutex:
            name = self.manifest.new_segment_name("base")
            return name, segment_header(self.manifest, name)

    def install_base(self, base_name: str, replaced: Sequence[str]) -> None:
        """Swap ``replaced`` (a prefix of the manifest) for the new base, atomically; delete the old files."""
        with self._mutex:
            self._check_open()
            if self._failure is not None:
                raise LogError(f"the log {self.dir} is failed ({self._failure}); the compacted base is not installed")
            try:
                install_base(self.dir, self.manifest, base_name, replaced, io=self._io)
            except DirSyncError as e:
                self._mark_failed((self._durable_epoch or 0) + 1, (
                    f"installing base {base_name}: the manifest naming it is in place, but fsyncing the directory "
                    f"after it failed ({_describe(e)})"))
                raise

    def bytes_since_base(self) -> int:
        with self._mutex:
            return sum(os.path.getsize(self.dir / n) for n in self.manifest.incr if (self.dir / n).exists())

    def base_bytes(self) -> int:
        b = self.manifest.base
        return os.path.getsize(self.dir / b) if b and (self.dir / b).exists() else 0

    # ----------------------------------------------------------------------------------------- closing
    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"the log {self.dir} is closed")

    def close(self) -> None:
        """Sync (unless ``fsync="never"``), close, release the lock. Raises ``CheckpointError`` when the final
        sync fails, or when the log failed in the background and no call has raised that yet."""
        err: CheckpointError | None = None
        if self._spare is not None:
            self._spare.stop()  # the worker finishes what it does (closing joins it)
        with self._mutex:
            if self._closed:
                return
            if self.replayed is not None:
                self.replayed.close()
                self.replayed = None
            self._stop.set()
            try:
                if self.options.fsync != "never" and self._failure is None:
                    self._sync_active(f"fdatasync of {self._segment.path.name} at close")
            except _WriteFailed:
                pass  # the log is failed: reported below
            finally:
                self._segment.close(quietly=True)
                if self._spare is not None:
                    self._spare.close()
                if self._crc_pool is not None:
                    self._crc_pool.shutdown(wait=False)
                self._closed = True
                self._lock.release()
            if self._failure is not None and not self._failure_reported:
                err = self._error((self.last_epoch or 0) + 1, self._failure)
        if self._syncer is not None:
            self._syncer.join(timeout=5)
        if err is not None:
            raise err

    def __enter__(self) -> RecoveryLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def install_base(log_dir: Path, manifest: Manifest, base_name: str, replaced: Sequence[str], *,
                 io: OsCalls = REAL_OS) -> None:
    """Swap ``replaced`` (a prefix of the manifest) for ``base_name``, atomically; delete the replaced files.
    ``manifest`` changes only once the new one is in place (also when only the directory fsync then fails)."""
    current = manifest.segments()
    if list(replaced) != current[: len(replaced)]:
        raise ConfigError(f"segments {list(replaced)} are not a prefix of the manifest {current}")
    new = manifest.copy()
    new.base = base_name
    new.incr = [n for n in current[len(replaced) :] if n != base_name]
    try:
        store_manifest(log_dir, new, io=io)
    except DirSyncError:  # the new manifest is in place (its durability unknown): say what it names
        manifest.base, manifest.incr = new.base, new.incr
        raise
    manifest.base, manifest.incr = new.base, new.incr
    for name in replaced:
        if name != base_name:
            io.unlink_quietly(log_dir / name)  # what stays is an orphan: the next open deletes it
    try:
        io.fsync_dir(log_dir)
    except OSError as e:  # the manifest no longer names them: reappearing after a crash, they are orphans
        log.warning("fsync of %s after deleting compacted segments failed: %s", log_dir, _describe(e))


def segment_header(manifest: Manifest, name: str) -> bytes:
    """The header of segment ``name`` of this log (kind and generation come from the name)."""
    m = SEGMENT_RE.match(name)
    assert m is not None, name
    kind = SEGMENT_BASE if m.group(1) == "base" else SEGMENT_INCR
    return SegmentHeader(kind, bytes.fromhex(manifest.log_id), int(m.group(2)), time.time_ns()).encode()


__all__ = ["AppendResult", "LogOptions", "OpenReport", "PlacedPayload", "RecoveryLog", "TailLease"]
