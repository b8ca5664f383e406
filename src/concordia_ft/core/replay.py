"""Replay: base + every committed epoch after it, verified, into host buffers. A reader never cuts anything.

``replay(log_dir)`` returns a ``ReplayResult`` with a named ``outcome``:

- ``ok``: every byte of the log belongs to a committed epoch (trailing zero bytes from preallocation aside);
- ``empty``: no log, or a log without a committed epoch;
- ``torn-tail``: the last epoch of the last segment was cut short (a write that never finished): it was never
  committed, it is not applied, and a writer reopening the log cuts it;
- ``damaged-tail``: the last epoch is whole in length but fails a checksum: it is not applied; a writer
  refuses to continue until `concordia log check DIR --fix` cuts it (that epoch is lost).

Damage anywhere before the tail raises ``LogCorruptError(path, offset, reason)``: the state after that point
cannot be trusted, and nothing is silently skipped.

Two passes. Pass 1 verifies: per segment, the epochs' structure is walked on the calling thread (headers,
descriptors, commit markers: small), then every payload checksum is checked, on a thread pool in chunks when
the segment is large, then the epochs are applied to the replay state in order up to the first failure of any
kind, so the earliest damage wins exactly as a one-epoch-at-a-time check would report it. Pass 2 copies each
live page's newest committed version once into region images (images.py); ``materialize=False`` defers it,
keeping the mapped segments open, so a caller that learns later where the bytes must go (pinned host memory
for a GPU) chooses the allocator then (``ReplayResult.materialize``).
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, LogCorruptError, LogError
from .checksums import ChecksumItem, first_mismatch
from .epochs import DecodedEpoch, EpochTail, TailKind, decode_epoch, entry_meta, entry_pages, entry_spec
from .format import (
    EPOCH_HEADER_BYTES,
    EPOCH_MAGIC,
    REC_DROP,
    REC_META,
    REC_PAGES,
    REC_REGION,
    REC_RUNS,
    SEGMENT_BASE,
    SEGMENT_HEADER_BYTES,
    EpochHeader,
    FormatError,
    NewerFormatError,
    SegmentHeader,
)
from .images import ImageAlloc, PageWrite, RegionImage, default_threads, materialize_images
from .manifest import Manifest, load_manifest
from .options import coerce_options
from .regions import RegionSpec
from .segment import map_segment
from .snapshot import RegionPages, region_pages
from .streamed import DeferredCheck, StreamedPlan, first_bad_deferred, plan_streamed, populate_read

__all__ = ["DeferredCheck", "EpochSummary", "Outcome", "PendingImages", "RegionImage", "ReplayOptions", "ReplayResult",
           "ReplayTimings", "TailInfo", "replay", "walk_segment"]


@dataclass(frozen=True)
class ReplayOptions:
    """How replay uses the machine. No option skips or weakens a check."""

    threads: int | None = None  # checksum and copy threads; None: default_threads(); 1: the calling thread only
    parallel_verify: bool = True  # False: checksums on the calling thread, one payload after another
    chunk_bytes: int = 8 << 20  # checksum work unit: a larger payload is split and the pieces combined
    parallel_min_bytes: int = 16 << 20  # smaller segments are checksummed, smaller copies done, on one thread
    # regions whose page payloads pass 1 does not checksum: their checks are handed to whoever uses the bytes
    # (``PendingImages.deferred``), who runs each one before any byte of the region leaves (a streamed restore
    # fuses them with its copy: every byte is read once). Pass 1 then applies epochs whose payload is damaged,
    # so the result is only usable once the deferred checks passed; a writer's open (the Runtime) refuses any
    # damage anyway, so for it the outcome is the same, the error comes later. Readers leave this empty.
    defer: tuple[str, ...] = ()
    # threads that map the segments' pages into this process (MADV_POPULATE_READ) while pass 1 runs, so whoever
    # reads the deferred payloads next (a streamed restore's copy threads) takes no first-touch page faults;
    # 0: none. Only segments that pass 1 does not populate itself (MAP_POPULATE on a serial check)
    populate: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.populate, int) or self.populate < 0:
            raise ConfigError(f"ReplayOptions.populate={self.populate!r}: use an int >= 0")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"ReplayOptions.threads={self.threads!r}: use None (automatic) or an int >= 1")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 64 << 10:
            raise ConfigError(f"ReplayOptions.chunk_bytes={self.chunk_bytes!r}: use an int >= 65536")
        if not isinstance(self.parallel_min_bytes, int) or self.parallel_min_bytes < 0:
            raise ConfigError(f"ReplayOptions.parallel_min_bytes={self.parallel_min_bytes!r}: use an int >= 0")
        if not isinstance(self.defer, tuple) or not all(isinstance(n, str) for n in self.defer):
            raise ConfigError(f"ReplayOptions.defer={self.defer!r}: use a tuple of region names")

    @property
    def workers(self) -> int:
        return self.threads if self.threads is not None else default_threads()

    @classmethod
    def coerce(cls, value: ReplayOptions | Mapping[str, Any] | None) -> ReplayOptions:
        return coerce_options(cls, value, "replay")


@dataclass
class ReplayTimings:
    """Where a replay spent its time (wall seconds) and how many bytes each pass handled."""

    verify_s: float = 0.0  # pass 1: map segments, check every epoch (payload checksums included), check records
    copy_s: float = 0.0  # pass 2: newest version of every live page into the region images (and zero fill)
    verify_bytes: int = 0  # payload bytes checksummed
    copy_bytes: int = 0  # image bytes written
    threads: int = 1
    populate_bytes: int = 0  # bytes handed to the populate threads (ReplayOptions.populate)


class Outcome(str, enum.Enum):
    OK = "ok"
    EMPTY = "empty"
    TORN_TAIL = "torn-tail"
    DAMAGED_TAIL = "damaged-tail"


@dataclass
class TailInfo:
    segment: str
    offset: int  # where the unusable bytes start (= end of the last good epoch)
    size_bytes: int  # bytes from offset to the end of the file
    kind: TailKind
    reason: str
    written_end: int = 0  # just past the tail's last nonzero byte (what a preallocated segment must clear)


@dataclass
class EpochSummary:
    epoch: int
    segment: str
    offset: int
    total_bytes: int
    payload_bytes: int
    full: bool
    pages: dict[str, int]
    region_bytes: int = 0  # bytes of all regions after this epoch: what a full copy would write


@dataclass
class ReplayResult:
    outcome: Outcome
    epoch: int | None
    regions: dict[str, RegionImage]
    meta: Any
    manifest: Manifest | None
    tail: TailInfo | None = None
    end_segment: str | None = None
    end_offset: int = 0
    trailing_zero_bytes: int = 0
    epochs: list[EpochSummary] = field(default_factory=list)
    bytes_read: int = 0
    suffix_bytes: int = 0  # bytes of the committed epochs in incremental segments (what compaction would fold)
    pending: PendingImages | None = None  # pass 2 not run yet (replay(..., materialize=False))
    timings: ReplayTimings = field(default_factory=ReplayTimings)
    released: bool = False  # close() dropped a deferred copy pass: these images will never exist

    @property
    def specs(self) -> dict[str, RegionSpec]:
        if self.pending is not None:
            return dict(self.pending.specs)
        return {n: r.spec for n, r in self.regions.items()}

    def materialize(self, allocs: Mapping[str, ImageAlloc] | None = None) -> dict[str, RegionImage]:
        """Run the deferred copy pass into ``regions`` (``allocs``: region name -> image allocator, default
        zeroed numpy memory) and release the mapped segments. A no-op when the images exist already."""
        if self.pending is None:
            if self.released:
                raise LogError("this replay's mapped segments were released before its copy pass; replay the "
                               "log again")
            return self.regions
        pending, self.pending = self.pending, None
        try:
            pending.check_deferred()
            self.regions = pending.materialize(allocs, self.timings)
        finally:
            pending.close()
        return self.regions

    def close(self) -> None:
        """Release the mapped segments of a deferred copy pass without copying (idempotent)."""
        if self.pending is not None:
            self.pending.close()
            self.pending = None
            self.released = True


MAX_REGION_BYTES = 1 << 44  # 16 TiB: a format bound, checked before anything is allocated


def host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return MAX_REGION_BYTES


class _State:
    """Pass 1's state: the regions' geometry and, per region, which committed records wrote which pages.
    Nothing is copied here (see images.py for pass 2)."""

    def __init__(self) -> None:
        # recovered regions live in host memory: never allocate past it (a hostile or damaged size field)
        self.limit_bytes = min(MAX_REGION_BYTES, host_memory_bytes())
        self.specs: dict[str, RegionSpec] = {}
        self.born: dict[str, int] = {}  # name -> sequence number where the region's current contents began
        self.writes: list[PageWrite] = []
        self.seq = 0
        self.meta: Any = None
        self.epoch: int | None = None
        self.deferred: list[DeferredCheck] = []  # ReplayOptions.defer: checks not run yet

    def add(self, ep: DecodedEpoch, path: str) -> dict[str, int]:
        """Check every record of a verified epoch against the region geometry; nothing is copied yet."""
        specs = {} if ep.full else dict(self.specs)
        born = {} if ep.full else dict(self.born)
        writes: list[PageWrite] = []
        meta, has_meta = None, False
        pages_of: dict[str, int] = {}
        seq = self.seq
        try:
            for e in ep.entries:
                seq += 1
                if e.rtype == REC_REGION:
                    spec = entry_spec(e)
                    others = sum(sp.nbytes for n, sp in specs.items() if n != spec.name)
                    if spec.n_pages * spec.page_bytes + others > self.limit_bytes:
                        raise FormatError(f"region {spec.name!r} declares {spec.nbytes} bytes ({others} in other "
                                          f"regions): more than this machine's {self.limit_bytes} bytes of memory "
                                          "(a damaged size field, or a log from a machine with more memory)")
                    if specs.get(spec.name) != spec:  # new, or redefined: starts from zeros
                        born[spec.name] = seq
                    specs[spec.name] = spec
                elif e.rtype == REC_DROP:
                    specs.pop(e.name, None)
                    born.pop(e.name, None)
                elif e.rtype in (REC_PAGES, REC_RUNS):
                    if e.name not in specs:
                        raise FormatError(f"pages for region {e.name!r}, which no earlier record defines")
                    pages = entry_pages(e, specs[e.name])
                    pages_of[e.name] = len(pages)
                    if len(pages):
                        writes.append(PageWrite(seq, e.name, pages, ep.payload(e)))
                elif e.rtype == REC_META:
                    meta, has_meta = entry_meta(e), True
        except FormatError as err:
            raise LogCorruptError(path, ep.offset, f"epoch {ep.epoch}: {err}") from None
        self.specs, self.born, self.seq = specs, born, seq
        if ep.full:
            self.writes = []
        self.writes.extend(writes)
        if has_meta:
            self.meta = meta
        self.epoch = ep.epoch
        return pages_of

    def region_bytes(self) -> int:
        return sum(sp.nbytes for sp in self.specs.values())


class PendingImages:
    """Pass 1's verified writes, their payloads still in the mapped segments (kept open until ``close``)."""

    def __init__(self, state: _State, mappings: list[mmap.mmap], options: ReplayOptions,
                 populator: Populator | None = None, names: list[str] | None = None) -> None:
        self._state = state
        self._mappings: list[mmap.mmap] | None = mappings
        self._names = list(names) if names is not None else []  # the segment each mapping is of
        self._options = options
        self._populator = populator

    def mapped_segments(self) -> list[tuple[str, int, int]]:
        """(segment name, host address, length) of each mapping the pending payloads point into."""
        if self._mappings is None or len(self._names) != len(self._mappings):
            return []
        return [(n, int(np.frombuffer(m, dtype=np.uint8).ctypes.data), len(m))
                for n, m in zip(self._names, self._mappings, strict=True) if not m.closed]

    def populate_stats(self) -> dict[str, float]:
        """What the populate threads (``ReplayOptions.populate``) did so far: bytes mapped in, pieces left."""
        return self._populator.stats() if self._populator is not None else {}

    @property
    def specs(self) -> Mapping[str, RegionSpec]:
        return self._state.specs

    @property
    def deferred(self) -> list[DeferredCheck]:
        """Checks pass 1 left (``ReplayOptions.defer``) and nobody has run yet."""
        return self._state.deferred

    def take_deferred(self, name: str) -> list[DeferredCheck]:
        """Hand region ``name``'s deferred checks to a caller who runs them (a streamed restore)."""
        mine = [c for c in self._state.deferred if c.name == name]
        self._state.deferred = [c for c in self._state.deferred if c.name != name]
        return mine

    def check_deferred(self, pool: Executor | None = None) -> None:
        """Run every deferred check not handed out; LogCorruptError for the earliest that fails."""
        checks, self._state.deferred = self._state.deferred, []
        if not checks:
            return
        workers = self._options.workers
        own = pool is None and workers > 1 and sum(c.data.nbytes for c in checks) >= self._options.parallel_min_bytes
        ex = ThreadPoolExecutor(workers, thread_name_prefix="concordia-replay") if own else pool
        try:
            bad = first_bad_deferred(checks, ex, workers, self._options.chunk_bytes)
        finally:
            if own and ex is not None:
                ex.shutdown(wait=False)
        if bad is not None:
            self._state.deferred = checks  # still not passed: anyone asking again gets the error again
            raise bad.error()

    def region_pages(self) -> list[RegionPages]:
        """Each region's newest committed page versions, read in place from the mapped segments (valid
        until ``close``): what a streamed base is written from, without building an image."""
        if self._mappings is None:
            raise LogError("this replay's segments were already released; replay the log again")
        return region_pages(self._state.specs, self._state.born, self._state.writes)

    def streamed_plan(self, name: str, slot_bytes: int) -> StreamedPlan:
        """The chunks that restore region ``name`` straight from the mapped segments (core/streamed.py);
        their source views are valid until ``close``."""
        if self._mappings is None:
            raise LogError("this replay's segments were already released; replay the log again")
        st = self._state
        # the region's deferred checksums go with the plan: the streamed restore runs them as it copies
        return plan_streamed(st.specs[name], st.born[name], st.writes, slot_bytes, self.take_deferred(name))

    def materialize(self, allocs: Mapping[str, ImageAlloc] | None, timings: ReplayTimings,
                    pool: Executor | None = None, skip: Collection[str] = ()) -> dict[str, RegionImage]:
        """Images of every region but ``skip`` (those are restored another way, e.g. streamed)."""
        if self._mappings is None:
            raise LogError("this replay's segments were already released; replay the log again")
        if any(c.name not in skip for c in self._state.deferred):
            raise LogError("materialize: deferred checksums of the regions to build were not run; call "
                           "check_deferred() first")
        t0 = time.perf_counter()
        specs = {n: sp for n, sp in self._state.specs.items() if n not in skip} if skip else self._state.specs
        images, written = materialize_images(specs, self._state.born, self._state.writes,
                                             allocs=allocs, threads=self._options.workers, pool=pool,
                                             parallel_min_bytes=self._options.parallel_min_bytes)
        timings.copy_s += time.perf_counter() - t0
        timings.copy_bytes += written
        return images

    def close(self) -> None:
        self._state.writes = []  # the payload views point into the mappings: drop them first
        if self._populator is not None:  # no madvise may run on an address range after it is unmapped
            self._populator.stop()
        mappings: list[Any] = list(self._mappings or [])
        self._mappings = None
        if sum(len(m) for m in mappings) >= BACKGROUND_UNMAP_BYTES:
            # unmapping a large populated mapping tears down a page table entry per 4 KiB (~24 ms for 232 MB on
            # the H200 host) and stalls the whole process meanwhile: profiled there, an unmap running beside the
            # restore stretched its other work from ~25 to ~50 ms. So the unmapper waits
            # BACKGROUND_UNMAP_DELAY_S first: off recovery's critical path (restore + first token)
            _queue_unmap(mappings)
        else:
            _unmap(mappings)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


POPULATE_PIECE = 64 << 20  # one madvise call of a populate thread (a stop waits for at most one per thread)


class Populator:
    """Threads that fault mapped segments into the page tables ahead of their readers (``MADV_POPULATE_READ``,
    Linux >= 5.14; the GIL is released for each call). On tmpfs this runs at 170-240 GB/s on 8-16 threads of
    the H200 host (serve/DESIGN.md, "Which host path"), while a memcpy that first-touches the pages reaches
    45 GB/s against 52 on pages already mapped. Best effort: a kernel without it (EINVAL) stops the work and
    the readers fault the pages themselves; nothing read depends on it."""

    def __init__(self, threads: int) -> None:
        self._ex = ThreadPoolExecutor(threads, thread_name_prefix="concordia-populate")
        self._futures: list[Future[int]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._done = 0
        self._lock = threading.Lock()

    def add(self, mapping: mmap.mmap) -> int:
        """Queue ``mapping``'s pages (in order, ``POPULATE_PIECE`` at a time); returns the bytes queued."""
        n = len(mapping)
        if n == 0 or self._stop.is_set():
            return 0
        addr = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
        for off in range(0, n, POPULATE_PIECE):
            self._futures.append(self._ex.submit(self._piece, addr + off, min(POPULATE_PIECE, n - off)))
        return n

    def _piece(self, addr: int, n: int) -> int:
        if self._stop.is_set():
            return 0
        if not populate_read(addr, n):
            self._stop.set()  # not supported here (or the range is gone): the readers fault the pages
            return 0
        with self._lock:
            self._done += n
            self._last = time.perf_counter()
        return n

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"populated_bytes": float(self._done),
                    "populate_s": max(0.0, self._last - self._t0) if self._done else 0.0,
                    "populate_pending": float(sum(not f.done() for f in self._futures))}

    def stop(self) -> None:
        """No new piece starts; returns once the running ones ended (before the mappings are unmapped)."""
        self._stop.set()
        for f in self._futures:
            f.cancel()
        self._ex.shutdown(wait=True)


BACKGROUND_UNMAP_BYTES = 64 << 20
BACKGROUND_UNMAP_DELAY_S = 2.0  # after a recovery's first token on every host we measured
_unmap_queue: queue.SimpleQueue[tuple[float, list[mmap.mmap]]] | None = None
_unmap_pid = 0  # the process whose thread serves the queue (a fork() child starts its own)
_unmap_lock = threading.Lock()


def _unmap(mappings: list[mmap.mmap]) -> None:
    for m in mappings:
        # an exception's traceback may still hold views of a mapping: then it is freed with them
        with contextlib.suppress(BufferError):
            m.close()


_unmap_cv = threading.Condition()
_unmap_pending = 0  # mapping lists queued and not yet unmapped
_unmap_now = False  # flush_unmaps(): no more waiting for the delay


def _unmapper() -> queue.SimpleQueue[tuple[float, list[mmap.mmap]]]:
    """The queue of ONE daemon thread per process that unmaps what it is given (started on first use: a
    thread started per release would cost its start-up wait, several ms on a busy host)."""
    global _unmap_queue, _unmap_pid, _unmap_pending
    with _unmap_lock:
        if _unmap_queue is None or _unmap_pid != os.getpid():
            q: queue.SimpleQueue[tuple[float, list[mmap.mmap]]] = queue.SimpleQueue()

            def loop() -> None:
                global _unmap_pending
                while True:
                    due, mappings = q.get()
                    with _unmap_cv:
                        while not _unmap_now and (left := due - time.monotonic()) > 0:
                            _unmap_cv.wait(left)
                    _unmap(mappings)
                    with _unmap_cv:
                        _unmap_pending -= 1
                        _unmap_cv.notify_all()

            threading.Thread(target=loop, name="concordia-unmap", daemon=True).start()
            _unmap_queue, _unmap_pid = q, os.getpid()
            with _unmap_cv:
                _unmap_pending = 0
        return _unmap_queue


def _queue_unmap(mappings: list[Any]) -> None:
    global _unmap_pending
    q = _unmapper()
    with _unmap_cv:
        _unmap_pending += 1
    q.put((time.monotonic() + BACKGROUND_UNMAP_DELAY_S, mappings))


def flush_unmaps(timeout: float | None = 30.0) -> bool:
    """Unmap now every log mapping a closed replay left to the background unmapper (which otherwise waits
    BACKGROUND_UNMAP_DELAY_S, to stay off a recovery's critical path), and wait until it is done. A process that
    opens logs one after another (a benchmark's rounds, a test) calls this between them, so that one open's
    unmap does not land in the next one's (the unmap holds the process's memory-map lock that the next open's
    mappings and page faults need). Returns False if ``timeout`` passed first."""
    global _unmap_now
    with _unmap_cv:
        if _unmap_pending == 0 or _unmap_pid != os.getpid():
            return True
        _unmap_now = True
        _unmap_cv.notify_all()
        try:
            return _unmap_cv.wait_for(lambda: _unmap_pending == 0, timeout=timeout)
        finally:
            _unmap_now = False


def _valid_epoch_header_after(buf: memoryview, start: int) -> int | None:
    """Offset of the next epoch header with a good checksum after ``start``, if any (damage vs tail)."""
    obj = buf.obj
    raw: Any = obj if hasattr(obj, "find") and len(obj) == len(buf) else bytes(buf)  # type: ignore[arg-type]
    pos = start
    while (idx := int(raw.find(EPOCH_MAGIC, pos))) >= 0:
        try:
            EpochHeader.decode(buf[idx : idx + EPOCH_HEADER_BYTES])
            return idx
        except FormatError:
            pos = idx + 1
    return None


def _open_segments(log_dir: Path, manifest: Manifest, names: list[str] | None
                   ) -> tuple[list[str], list[int], Manifest]:
    """Open every segment before replaying any: an open file survives a concurrent compaction's unlink.

    If a segment vanished between reading the manifest and opening it, a compaction swapped the manifest:
    read it again and retry (bounded). A segment missing from an unchanged manifest is real damage.
    """
    for _ in range(16):
        want = names if names is not None else manifest.segments()
        fds: list[int] = []
        try:
            for n in want:
                fds.append(os.open(log_dir / n, os.O_RDONLY))
            return want, fds, manifest
        except FileNotFoundError as e:
            for fd in fds:
                os.close(fd)
            newer = load_manifest(log_dir) if names is None else None
            if newer is None or newer.segments() == manifest.segments():
                raise LogCorruptError(str(e.filename), 0, "segment named in the manifest is missing",
                                      "restore it from a replica, or the log cannot be replayed past this point"
                                      ) from None
            manifest = newer
    raise LogError(f"{log_dir}: the manifest kept changing while it was being read (16 tries); is a compaction "
                   "looping? Try again once it is done")


def unborn_segment(path: Path) -> bool:
    """A segment file that holds nothing past its header (or less than a header): what a writer killed while
    creating its first segment, before the manifest named it, leaves behind (a preallocated one: zeros)."""
    from .format import SEGMENT_HEADER_BYTES

    try:
        with open(path, "rb") as f:
            f.seek(SEGMENT_HEADER_BYTES)
            while chunk := f.read(1 << 20):
                if chunk.strip(b"\x00"):
                    return False
    except OSError:
        return False
    return True


def _all_zero(buf: memoryview, start: int) -> bool:
    """Every byte from ``start`` is zero (a preallocated segment's unused tail): the bulk read as 8-byte words."""
    n = len(buf) - start
    head = (-start) % 8 if n > 8 else n
    if np.frombuffer(buf[start:start + head], dtype=np.uint8).any():
        return False
    mid = (n - head) // 8 * 8
    if mid and np.frombuffer(buf[start + head:start + head + mid], dtype=np.uint64).any():
        return False
    return not np.frombuffer(buf[start + head + mid:], dtype=np.uint8).any()


def replay(log_dir: str | Path, *, verify_payloads: bool = True, segments: Sequence[str] | None = None,
           collect_summaries: bool = False, manifest: Manifest | None = None,
           on_epoch: Callable[[EpochSummary], None] | None = None,
           options: ReplayOptions | Mapping[str, Any] | None = None, materialize: bool = True,
           allocs: Mapping[str, ImageAlloc] | None = None) -> ReplayResult:
    """Replay the log in ``log_dir`` (or only ``segments``, a prefix of the manifest's list).

    ``materialize=False`` stops after pass 1: the result's ``pending`` holds the verified writes and the
    mapped segments until ``result.materialize(allocs)`` or ``result.close()``."""
    log_dir = Path(log_dir)
    opts = ReplayOptions.coerce(options)
    if manifest is None:
        manifest = load_manifest(log_dir)
    if manifest is None:
        if log_dir.is_dir() and not all(unborn_segment(p) for p in log_dir.glob("*.cft")):
            raise LogError(f"{log_dir} holds segment files but no MANIFEST; it was not written by a complete "
                           "`Runtime` start. Run `concordia log check DIR` to see what is there")
        # no segment, or only the first segment of a first open killed before its manifest was stored: it holds
        # no epoch (the manifest is stored before the first epoch is written), so nothing was ever committed
        return ReplayResult(Outcome.EMPTY, None, {}, None, None)
    t0 = time.perf_counter()
    names, fds, manifest = _open_segments(log_dir, manifest, list(segments) if segments is not None else None)
    st = _State()
    mappings: list[mmap.mmap] = []
    mapped_names: list[str] = []
    pool: ThreadPoolExecutor | None = None
    result = ReplayResult(Outcome.OK, None, {}, None, manifest)
    result.timings.threads = opts.workers
    populator = Populator(opts.populate) if opts.populate > 0 else None
    try:
        for i, (name, fd) in enumerate(zip(names, fds, strict=True)):
            last = i == len(names) - 1
            parallel = (verify_payloads and opts.parallel_verify and opts.workers > 1
                        and os.fstat(fd).st_size >= opts.parallel_min_bytes)
            if parallel and pool is None:
                pool = ThreadPoolExecutor(opts.workers, thread_name_prefix="concordia-replay")
            # a parallel check faults the mapping in on every thread; a serial one is faster pre-faulted, unless
            # the populate threads do it beside the check
            mapping, buf = map_segment(fd, populate=not parallel and populator is None)
            if mapping is not None:
                mappings.append(mapping)
                mapped_names.append(name)
                if populator is not None:
                    result.timings.populate_bytes += populator.add(mapping)
            seg = _Segment(name, str(log_dir / name), buf, last, i == 0)
            _replay_segment(st, result, seg, manifest, verify_payloads, collect_summaries, on_epoch,
                            pool if parallel else None, opts)
            del buf, seg
            if result.tail is not None:
                break
        result.timings.verify_s = time.perf_counter() - t0
        result.epoch, result.meta = st.epoch, st.meta
        if st.epoch is None and result.outcome is Outcome.OK:
            result.outcome = Outcome.EMPTY
        if st.epoch is not None:
            result.pending = PendingImages(st, mappings, opts, populator, mapped_names)
            mappings, populator = [], None  # the pending pass owns them now
            if materialize:
                pending, result.pending = result.pending, None
                try:
                    pending.check_deferred(pool)
                    result.regions = pending.materialize(allocs, result.timings, pool)
                finally:
                    pending.close()
    finally:
        if pool is not None:
            pool.shutdown(wait=False)  # idle once the work is back; joining them costs ms on a busy host
        if mappings or populator is not None:
            st.writes = []
            PendingImages(st, mappings, opts, populator).close()
        for fd in fds:
            os.close(fd)
    return result


@dataclass
class _Segment:
    name: str
    path: str
    buf: memoryview
    last: bool  # the last segment replayed: only here can an unusable epoch be a tail
    first: bool


def _replay_segment(st: _State, result: ReplayResult, seg: _Segment, manifest: Manifest, verify: bool,
                    summaries: bool, on_epoch: Callable[[EpochSummary], None] | None, pool: Executor | None,
                    opts: ReplayOptions) -> None:
    buf, path = seg.buf, seg.path
    size = len(buf)
    if size < SEGMENT_HEADER_BYTES:
        if seg.last and _all_zero(buf, 0):
            result.tail = TailInfo(seg.name, 0, size, TailKind.TORN, "segment header never finished")
            result.outcome = Outcome.TORN_TAIL
            return
        raise LogCorruptError(path, 0, f"segment is {size} bytes, shorter than its header")
    try:
        header = SegmentHeader.decode(buf[:SEGMENT_HEADER_BYTES])
    except FormatError as e:
        raise LogCorruptError(path, 0, str(e)) from None
    if header.log_id.hex() != manifest.log_id:
        raise LogCorruptError(path, 0, f"segment belongs to log {header.log_id.hex()}, not {manifest.log_id}",
                              "a segment from another log was copied in; remove it from this directory")
    if header.kind == SEGMENT_BASE and not seg.first:
        raise LogCorruptError(path, 0, "a base segment appears after the first position in the manifest")
    result.end_segment, result.end_offset = seg.name, SEGMENT_HEADER_BYTES
    epochs, stop = walk_segment(buf, SEGMENT_HEADER_BYTES)
    bad: tuple[int, str] | None = None  # (index in epochs, reason) of the first payload that fails its checksum
    deferred: dict[int, list[int]] = {}  # epoch index -> records whose checksum is deferred (opts.defer)
    if verify:
        bad = _first_bad_payload(epochs, pool, opts, result.timings, deferred)
    for i, ep in enumerate(epochs):
        if bad is not None and i == bad[0]:
            _stop(st, result, seg, ep.offset, EpochTail(TailKind.DAMAGED, bad[1]))
            return
        pos = ep.offset
        if st.epoch is not None and not ep.full and ep.epoch != st.epoch + 1:
            raise LogCorruptError(path, pos, f"epoch {ep.epoch} follows epoch {st.epoch}: epochs are missing")
        if st.epoch is not None and ep.full and ep.epoch <= st.epoch:
            raise LogCorruptError(path, pos, f"base epoch {ep.epoch} does not advance past epoch {st.epoch}")
        seq0 = st.seq
        pages = st.add(ep, path)
        for r in deferred.get(i, ()):
            ent = ep.entries[r]
            st.deferred.append(DeferredCheck(seq0 + r + 1, ent.name, path, ep.offset, ep.epoch, r, ep.payload(ent),
                                             ent.payload_crc))
        result.bytes_read += ep.total_bytes
        if header.kind != SEGMENT_BASE:
            result.suffix_bytes += ep.total_bytes
        result.end_offset = pos + ep.total_bytes
        if summaries or on_epoch is not None:
            s = EpochSummary(ep.epoch, seg.name, ep.offset, ep.total_bytes, ep.payload_bytes, ep.full, pages,
                             st.region_bytes())
            if summaries:
                result.epochs.append(s)
            if on_epoch is not None:
                on_epoch(s)
    if stop is not None:
        pos, exc = stop
        if isinstance(exc, NewerFormatError):
            raise LogError(f"{path} at offset {pos}: {exc}") from None
        _stop(st, result, seg, pos, exc)


def walk_segment(buf: memoryview, pos: int
                 ) -> tuple[list[DecodedEpoch], tuple[int, EpochTail | NewerFormatError] | None]:
    """Every epoch whose structure checks (header, descriptors, commit marker; payloads NOT checksummed),
    from ``pos`` until the end of the segment or the first one that does not: (its offset, why)."""
    epochs: list[DecodedEpoch] = []
    size = len(buf)
    while pos < size:
        try:
            ep = decode_epoch(buf, pos, verify_payloads=False)
        except (EpochTail, NewerFormatError) as e:
            return epochs, (pos, e)
        epochs.append(ep)
        pos += ep.total_bytes
    return epochs, None


def _first_bad_payload(epochs: list[DecodedEpoch], pool: Executor | None, opts: ReplayOptions,
                       timings: ReplayTimings, deferred: dict[int, list[int]]) -> tuple[int, str] | None:
    """(index, reason) of the earliest epoch with a payload that fails its checksum (its first such record).
    Page records of ``opts.defer`` regions are not checked: they are listed in ``deferred`` instead."""
    items = []
    for i, ep in enumerate(epochs):
        for r, e in enumerate(ep.entries):
            if not e.payload_len:
                continue
            if opts.defer and e.rtype in (REC_PAGES, REC_RUNS) and e.name in opts.defer:
                deferred.setdefault(i, []).append(r)
            else:
                items.append(ChecksumItem((i, r), ep.payload(e), e.payload_crc))
    timings.verify_bytes += sum(it.data.nbytes for it in items)
    bad = first_mismatch(items, pool=pool, workers=opts.workers if pool is not None else 1,
                         chunk_bytes=opts.chunk_bytes)
    if bad is None:
        return None
    i, r = bad.key
    ep = epochs[i]
    return i, f"epoch {ep.epoch} record {r} ({ep.entries[r].name!r}) payload checksum mismatch"


def _stop(st: _State, result: ReplayResult, seg: _Segment, pos: int, t: EpochTail) -> None:
    """The epoch at ``pos`` cannot be used: trailing zeros, a tail, or damage before the tail."""
    buf, path = seg.buf, seg.path
    size = len(buf)
    if _all_zero(buf, pos):
        result.trailing_zero_bytes = size - pos
        return
    if not seg.last:
        raise LogCorruptError(path, pos, t.reason,
                              "this is not the last segment: later epochs depend on this one") from None
    later = _valid_epoch_header_after(buf, pos + 1)
    if later is not None:
        raise LogCorruptError(path, pos, f"{t.reason} (a valid epoch follows at offset {later})",
                              "damage before the tail: the epochs before this offset are intact; "
                              "run `concordia log check DIR` for a full report") from None
    nonzero = np.flatnonzero(np.frombuffer(buf[pos:], dtype=np.uint8))
    written_end = pos + int(nonzero[-1]) + 1 if len(nonzero) else pos
    result.tail = TailInfo(seg.name, pos, size - pos, t.kind, t.reason, written_end)
    result.outcome = Outcome.TORN_TAIL if t.kind is TailKind.TORN else Outcome.DAMAGED_TAIL
