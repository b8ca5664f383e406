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
"""

from __future__ import annotations

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

from ..errors import ConfigError, LogCorruptError, LogLockedError
from .epochs import plan_epoch
from .format import SEGMENT_BASE, SEGMENT_INCR, SegmentHeader
from .manifest import SEGMENT_RE, Manifest, fsync_dir, store_manifest
from .mapped import MappedSegment, Registrar, SparePreparer
from .options import coerce_options
from .regions import RegionSpec
from .replay import Outcome, ReplayOptions, ReplayResult, replay
from .segment import DaxSegment, FileSegment, SegmentWriter, check_backend
from .tracking import RegionDelta

log = logging.getLogger("concordia_ft.log")

FSYNC_POLICIES = ("always", "interval", "never")
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

    def __post_init__(self) -> None:
        if self.mapped not in ("auto", "on", "off"):
            raise ConfigError(f"mapped={self.mapped!r}; use 'auto', 'on' or 'off'")
        if self.mapped == "on" and self.backend != "dram":
            raise ConfigError(f"mapped='on' needs backend 'dram' (tmpfs); the backend is {self.backend!r}")
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
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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


def _open_segment(path: Path, opts: LogOptions, *, header: bytes | None = None, end: int | None = None,
                  capacity: int = 0, register: Registrar | None = None) -> SegmentWriter:
    if opts.backend == "dax":
        return DaxSegment(path, opts.dax_segment_bytes, create_with=header, end=end)
    if opts.uses_mapped:
        cap = max(capacity, min(opts.mapped_segment_bytes, opts.segment_max_bytes))
        return MappedSegment(path, cap, create_with=header, end=end, register=register)
    return FileSegment(path, create_with=header)


def _preallocated(seg: SegmentWriter) -> bool:
    """The segment's file is longer than its epochs (zeros after): torn bytes are zeroed, not cut off."""
    return isinstance(seg, (DaxSegment, MappedSegment))


class PlacedPayload(Protocol):
    """A payload that is not in host memory yet (a device buffer): ``place(address)`` starts copying its
    ``nbytes`` bytes to that host address (a mapped segment's pages), ``wait()`` returns once they are there."""

    nbytes: int

    def place(self, address: int) -> None: ...

    def wait(self) -> None: ...


def _add_incr_segment(log_dir: Path, manifest: Manifest, opts: LogOptions, *, capacity: int = 0,
                      register: Registrar | None = None, spare: SparePreparer | None = None) -> SegmentWriter:
    """Create the next incremental segment (header synced), then name it in the manifest (atomically)."""
    name = manifest.new_segment_name("incr")
    header = segment_header(manifest, name)
    seg: SegmentWriter | None = None
    if spare is not None and opts.uses_mapped:
        seg = spare.take(log_dir / name, header, capacity)
    if seg is None:
        seg = _open_segment(log_dir / name, opts, header=header, capacity=capacity, register=register)
    manifest.incr.append(name)
    store_manifest(log_dir, manifest)
    return seg


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


class RecoveryLog:
    """The single writer of a log directory. Thread-safe: the compactor runs beside the appender."""

    def __init__(self, log_dir: Path, opts: LogOptions, lock: DirLock, manifest: Manifest,
                 segment: SegmentWriter, last_epoch: int | None, report: OpenReport,
                 replayed: ReplayResult | None) -> None:
        self.dir = log_dir
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
        self._syncer: threading.Thread | None = None
        self._stop = threading.Event()
        self._register: Registrar | None = None  # pins mapped segments with the driver (set by the CUDA layer)
        self._spare: SparePreparer | None = None
        self._crc_pool: Any = None
        if opts.fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="concordia-fsync", daemon=True)
            self._syncer.start()

    # ------------------------------------------------------------------------------------------ opening
    @classmethod
    def open(cls, log_dir: str | os.PathLike[str], options: LogOptions | dict[str, Any] | None = None, *,
             replay_options: ReplayOptions | dict[str, Any] | None = None) -> RecoveryLog:
        """Open (or create) the log for appending. The replay this takes verifies every epoch; its copy
        pass is deferred to whoever restores (``self.replayed``)."""
        opts = LogOptions.coerce(options)
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        check_backend(opts.backend, path)
        lock = DirLock(path, "writer")
        result: ReplayResult | None = None
        try:
            result = replay(path, options=replay_options, materialize=False)
            return cls._open_locked(path, opts, lock, result)
        except BaseException:
            if result is not None:
                result.close()
            lock.release()
            raise

    @classmethod
    def _open_locked(cls, path: Path, opts: LogOptions, lock: DirLock, result: ReplayResult) -> RecoveryLog:
        if result.manifest is None:
            manifest = Manifest(log_id=secrets.token_bytes(16).hex())
            seg = _add_incr_segment(path, manifest, opts)
            report = OpenReport(True, Outcome.EMPTY, None, durable=seg.durable)
            return cls(path, opts, lock, manifest, seg, None, report, result)
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
            seg = _add_incr_segment(path, manifest, opts)
            report.durable = seg.durable
            return cls(path, opts, lock, manifest, seg, result.epoch, report, result)
        last = manifest.segments()[-1]
        end = result.end_offset if result.end_segment == last else None
        if end is None:  # the tail segment never got its header: start it again
            (path / last).unlink(missing_ok=True)
            seg = _open_segment(path / last, opts, header=segment_header(manifest, last))
        else:
            seg = _open_segment(path / last, opts, end=end)
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
        report.durable = seg.durable
        return cls(path, opts, lock, manifest, seg, result.epoch, report, result)

    # ------------------------------------------------------------------------------------------ writing
    def append(self, *, defs: Sequence[RegionSpec] = (), drops: Sequence[str] = (),
               deltas: Sequence[RegionDelta] = (), meta: Any = None, epoch: int | None = None) -> AppendResult:
        """Write one epoch and commit it per the fsync policy. Returns once committed."""
        with self._mutex:
            self._check_open()
            number = (self.last_epoch or 0) + 1 if epoch is None else epoch
            if self.last_epoch is not None and number != self.last_epoch + 1:
                raise ConfigError(f"epoch {number} does not follow the last committed epoch {self.last_epoch}")
            # a payload that is still on a device (cuda.mapped.DevicePayload): DMA'd into the log's own pages
            placed = {i: d.payload for i, d in enumerate(deltas) if hasattr(d.payload, "place")}
            if placed:
                plan, offset = self._placed_append(number, list(defs), list(drops), list(deltas),
                                                   placed, meta)  # type: ignore[arg-type]
            else:
                plan = plan_epoch(number, self._segment.end, defs=list(defs), drops=list(drops),
                                  deltas=list(deltas), meta=meta)
                seg = self._segment
                if self._segment_epochs and seg.end + plan.total_bytes > self.options.segment_max_bytes or (
                        isinstance(seg, MappedSegment) and plan.total_bytes > seg.room()):
                    self._roll(plan.total_bytes)
                    plan = plan_epoch(number, self._segment.end, defs=list(defs), drops=list(drops),
                                      deltas=list(deltas), meta=meta)
                offset = self._segment.append(plan.parts)
            if self.options.fsync == "always":
                self._segment.sync()
            else:
                self._dirty = True
            self.last_epoch = number
            self._segment_epochs += 1
            return AppendResult(number, self._segment.path.name, offset, plan.total_bytes, plan.payload_bytes,
                                plan.n_pages, plan.region_pages)

    def _roll(self, need: int = 0) -> None:
        """Seal the active incremental segment and continue in a new one (manifest updated atomically)."""
        self._segment.sync()
        from .format import SEGMENT_HEADER_BYTES

        # the epoch is planned again at the new offset: its alignment padding can grow by up to a page
        seg = _add_incr_segment(self.dir, self.manifest, self.options, capacity=need + 2 * SEGMENT_HEADER_BYTES,
                                register=self._register, spare=self._spare)
        self._segment.close()
        self._segment = seg
        self._segment_epochs = 0
        if self._spare is not None:
            self._spare.start()

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
            if not isinstance(self._segment, MappedSegment):
                return
            self._register = register
            self._segment.register(register)
            if prepare_spare and self._spare is None:
                cap = min(self.options.mapped_segment_bytes, self.options.segment_max_bytes)
                self._spare = SparePreparer(self.dir, cap, register)
                self._spare.start()

    def _placed_append(self, number: int, defs: list[RegionSpec], drops: list[str], deltas: list[RegionDelta],
                       placed: dict[int, PlacedPayload], meta: Any) -> tuple[Any, int]:
        """One epoch whose payloads ``placed`` (index into ``deltas`` -> device payload) are DMA'd straight into
        the mapped segment at their final offsets; CRCs from the placed bytes; header, then commit marker."""
        from .checksums import crc32c_parallel

        plan = plan_epoch(number, self._segment.end, defs=defs, drops=drops, deltas=deltas, meta=meta,
                          payload_crcs=[0] * len(deltas))
        seg = self._segment
        if not isinstance(seg, MappedSegment) or plan.total_bytes > seg.room():
            self._roll(plan.total_bytes)
            seg = self._segment
            if not isinstance(seg, MappedSegment):
                raise ConfigError("placed payloads need a mapped segment (backend 'dram', mapped on)")
            plan = plan_epoch(number, seg.end, defs=defs, drops=drops, deltas=deltas, meta=meta,
                              payload_crcs=[0] * len(deltas))
        start = seg.end
        with_pages = [i for i, d in enumerate(deltas) if len(d.pages)]
        views: list[RegionDelta] = list(deltas)
        try:
            for k, i in enumerate(with_pages):
                p = placed.get(i)
                if p is not None:
                    p.place(seg.address + start + plan.payload_offsets[k])
            for k, i in enumerate(with_pages):
                p = placed.get(i)
                if p is not None:
                    p.wait()
                    d = deltas[i]
                    views[i] = RegionDelta(d.spec, d.pages, seg.view(start + plan.payload_offsets[k], p.nbytes),
                                           d.scanned_bytes)
            pool = self._crc_workers()
            crcs = [crc32c_parallel(views[i].payload, pool) for i in with_pages]
            plan = plan_epoch(number, start, defs=defs, drops=drops, deltas=views, meta=meta, payload_crcs=crcs)
            in_place = [plan.payload_parts[k] for k, i in enumerate(with_pages) if i in placed]
            seg.append_placed(plan.parts, in_place)
        except BaseException:
            seg.cut(start, start + plan.total_bytes)  # nothing of this epoch stays behind
            raise
        return plan, start

    def _crc_workers(self) -> Any:
        if self._crc_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._crc_pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                thread_name_prefix="concordia-crc")
        return self._crc_pool

    def sync(self) -> None:
        with self._mutex:
            if not self._closed:
                self._segment.sync()
                self._dirty = False

    def _sync_loop(self) -> None:
        period = self.options.fsync_interval_ms / 1000
        while not self._stop.wait(period):
            if self._dirty:
                try:
                    self.sync()
                except OSError as e:  # keep trying; the next append reports a real failure
                    log.error("background fsync of %s failed: %s", self.dir, e)

    # ------------------------------------------------------------------------------------ compaction
    def seal_for_compaction(self) -> list[str]:
        """Start a new incremental segment; return the sealed segments a compactor may rewrite."""
        with self._mutex:
            self._check_open()
            if self._segment_epochs:
                self._roll()
            return self.manifest.segments()[:-1]

    def reserve_base(self) -> tuple[str, bytes]:
        """The name and segment header of the next base segment a compactor writes."""
        with self._mutex:
            name = self.manifest.new_segment_name("base")
            return name, segment_header(self.manifest, name)

    def install_base(self, base_name: str, replaced: Sequence[str]) -> None:
        """Swap ``replaced`` (a prefix of the manifest) for the new base, atomically; delete the old files."""
        with self._mutex:
            self._check_open()
            install_base(self.dir, self.manifest, base_name, replaced)

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
        with self._mutex:
            if self._closed:
                return
            if self.replayed is not None:
                self.replayed.close()
                self.replayed = None
            self._stop.set()
            try:
                if self.options.fsync != "never":
                    self._segment.sync()
            finally:
                self._segment.close()
                if self._spare is not None:
                    self._spare.close()
                if self._crc_pool is not None:
                    self._crc_pool.shutdown(wait=False)
                self._closed = True
                self._lock.release()
        if self._syncer is not None:
            self._syncer.join(timeout=5)

    def __enter__(self) -> RecoveryLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def install_base(log_dir: Path, manifest: Manifest, base_name: str, replaced: Sequence[str]) -> None:
    current = manifest.segments()
    if list(replaced) != current[: len(replaced)]:
        raise ConfigError(f"segments {list(replaced)} are not a prefix of the manifest {current}")
    manifest.base = base_name
    manifest.incr = [n for n in current[len(replaced) :] if n != base_name]
    store_manifest(log_dir, manifest)
    for name in replaced:
        if name != base_name:
            (log_dir / name).unlink(missing_ok=True)
    fsync_dir(log_dir)


def segment_header(manifest: Manifest, name: str) -> bytes:
    """The header of segment ``name`` of this log (kind and generation come from the name)."""
    m = SEGMENT_RE.match(name)
    assert m is not None, name
    kind = SEGMENT_BASE if m.group(1) == "base" else SEGMENT_INCR
    return SegmentHeader(kind, bytes.fromhex(manifest.log_id), int(m.group(2)), time.time_ns()).encode()


__all__ = ["AppendResult", "LogOptions", "OpenReport", "PlacedPayload", "RecoveryLog"]
