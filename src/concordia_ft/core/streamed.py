"""Streamed restore: a verified log's newest page versions copied straight to a region's buffer through a ring.

The image path (images.py) builds a whole host image of a region, then the backend copies the image to the
buffer. For a GPU KV pool of 15-20 GB that means page-locking 15-20 GB of host memory (seconds), one copy of
every byte into it, then a DMA of the whole image. A streamed restore never builds the image:

1. ``plan_streamed`` walks the region's committed writes newest first (the bitmap of pages already supplied, as
   ``materialize_images`` does) and cuts the bytes that survive into **chunks** of at most ``slot_bytes``: a chunk
   is a list of contiguous source ranges in the log's mapped segments (one per surviving run of a record's
   payload; a decode epoch's 64 rows are ONE range) and the region page each of its pages goes to. Superseded
   pages are never copied; pages no write supplies are reported (``unfilled``) so the sink zeroes them.
2. ``run_streamed`` fills a ring of host slots on a thread pool (numpy copies, GIL released: one slot per
   thread at a time) and hands each filled slot to a **sink**, which sends it to the buffer asynchronously
   (the CUDA sink: one DMA into a device staging slot and one scatter kernel, or one DMA straight into place
   when the chunk's pages are one run) and tells when the slot may be refilled. Fills, DMA and scatter overlap.
   (The same loop in C with the GIL released was no faster on the H200: first token at 8B dims 1.076 vs
   1.176 s in one run, 0.92 vs 0.84 and 1.67 vs 1.12 s in others, within each other's spread; serve/DESIGN.md
   "Recovery", results serve_restore-h200-s12b.json in git history. It went.)

Verification: either the caller streams from a replay whose pass 1 verified every payload's checksum (at the
Runtime's open), or the plan carries the region's deferred checks (``ReplayOptions.defer``): each record's
payload is tiled by pieces, a piece's CRC32C is computed as it is copied (on the fill thread, or by the sink
on the device: ``verifies``), the pieces of a record are combined (the GF(2) shift, checksums.py) and compared
with the stored checksum before ``run_streamed`` returns. Either way the buffer is used only after it returned
(the sink's ``finish``), so no byte from a record that failed its check is ever served. The chunks write
disjoint pages, so their order does not matter.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, LogCorruptError
from .checksums import ChecksumItem, crc32c, crc32c_combine, crc32c_shift, first_mismatch
from .images import PageWrite
from .regions import RegionSpec
from .tracking import pages_to_runs

try:
    from . import _ntcopy  # type: ignore[attr-defined]
    _NT_WHY = ""
except ImportError as _e:  # not built: the fills use memcpy
    _ntcopy = None
    _NT_WHY = f"not built: {_e}"

_log = logging.getLogger(__name__)


def loop_status() -> str:
    """One line for ``concordia doctor``, build scripts and benchmark stamps: how the fills write the ring."""
    if _ntcopy is None:
        return f"fills with memcpy (the streaming-store copy is {_NT_WHY})"
    return f"fills with {_ntcopy.copy_impl()}"


@dataclass(frozen=True)
class DeferredCheck:
    """A page record's payload checksum that pass 1 left to the restore (``ReplayOptions.defer``)."""

    seq: int  # the record's sequence number (``PageWrite.seq`` of its pages)
    name: str
    path: str
    offset: int  # the epoch's offset in its segment
    epoch: int
    record: int
    data: memoryview
    expected: int

    def error(self) -> LogCorruptError:
        return LogCorruptError(self.path, self.offset, f"epoch {self.epoch} record {self.record} ({self.name!r}) "
                               "payload checksum mismatch (found by the restore that reads it)")


def first_bad_deferred(checks: Sequence[DeferredCheck], pool: Executor | None, workers: int,
                       chunk_bytes: int = 8 << 20) -> DeferredCheck | None:
    """The earliest deferred check that fails, or None."""
    if not checks:
        return None
    items = [ChecksumItem((c.seq,), c.data, c.expected) for c in checks]
    bad = first_mismatch(items, pool=pool, workers=workers if pool is not None else 1, chunk_bytes=chunk_bytes)
    if bad is None:
        return None
    return next(c for c in checks if c.seq == bad.key[0])



@dataclass
class Chunk:
    """What one ring slot carries: ``copies`` (source bytes, offset in the slot, the verification piece they
    are or -1), packed without gaps; page ``i`` of the slot goes to region page ``pages[i]``."""

    copies: list[tuple[memoryview, int, int]]
    pages: npt.NDArray[np.int64]
    nbytes: int
    run_start: int = -1  # >= 0: ``pages`` is the single run [run_start, run_start + len(pages))


@dataclass
class StreamedPlan:
    spec: RegionSpec
    chunks: list[Chunk]
    unfilled: int  # pages no committed write supplies (they must read as zeros)
    copy_bytes: int  # bytes the chunks carry (the surviving pages)
    superseded_bytes: int  # payload bytes of older versions, never copied
    records: int  # committed writes of the region considered
    # deferred checksums (ReplayOptions.defer) this restore runs: each record's payload is tiled by ``pieces``
    # (check index, offset in the payload, length); a piece is checksummed as it is copied, or on its own
    # (``crc_only``: the bytes of superseded versions) when nothing copies it
    checks: list[DeferredCheck] = field(default_factory=list)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    crc_only: list[tuple[int, memoryview]] = field(default_factory=list)


@dataclass
class StreamedStats:
    bytes: int = 0
    chunks: int = 0
    seconds: float = 0.0
    plan_s: float = 0.0
    fill_wait_s: float = 0.0  # the driving thread waiting for a slot's fill
    slot_wait_s: float = 0.0  # ... for a slot's transfer to finish (the sink is the bottleneck)
    finish_s: float = 0.0
    threads: int = 1
    direct_chunks: int = 0  # chunks sent straight into place (one run of pages, no scatter)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


def plan_streamed(spec: RegionSpec, born: int, writes: Sequence[PageWrite], slot_bytes: int,
                  checks: Sequence[DeferredCheck] = ()) -> StreamedPlan:
    """The chunks that restore region ``spec`` from ``writes`` (oldest first; only those of ``spec.name`` with
    ``seq >= born`` count): every page's newest version exactly once. ``checks``: the region's deferred
    checksums, to run on the way (every byte of each such record: copied or not)."""
    check_of = {c.seq: i for i, c in enumerate(checks)}
    pieces: list[tuple[int, int, int]] = []
    pb = spec.page_bytes
    if slot_bytes < pb:
        raise ConfigError(f"slot_bytes={slot_bytes} is smaller than region {spec.name!r}'s {pb}-byte pages")
    per_slot = slot_bytes // pb
    filled = np.zeros(spec.n_pages, dtype=bool)
    missing = spec.n_pages
    chunks: list[Chunk] = []
    cur_copies: list[tuple[memoryview, int, int]] = []
    cur_pages: list[npt.NDArray[np.int64]] = []
    cur_n = 0
    copy_bytes = superseded = records = 0

    def close_chunk() -> None:
        nonlocal cur_copies, cur_pages, cur_n
        if cur_n:
            pages = np.concatenate(cur_pages) if len(cur_pages) > 1 else cur_pages[0]
            run = int(pages[0]) if int(pages[-1]) - int(pages[0]) + 1 == len(pages) and _ascending_run(pages) else -1
            chunks.append(Chunk(cur_copies, pages, cur_n * pb, run))
        cur_copies, cur_pages, cur_n = [], [], 0

    for w in reversed(writes):
        if w.name != spec.name or w.seq < born:
            continue
        records += 1
        if not missing:
            superseded += len(w.pages) * pb
            continue
        need = ~filled[w.pages]
        n_need = int(np.count_nonzero(need))
        superseded += (len(w.pages) - n_need) * pb
        if n_need == 0:
            continue
        filled[w.pages] = True
        missing -= n_need
        copy_bytes += n_need * pb
        if n_need == len(w.pages):
            runs = np.array([[0, n_need]], dtype=np.int64)
        else:
            runs = pages_to_runs(np.flatnonzero(need).astype(np.int64))  # runs of positions in the payload
        ci = check_of.get(w.seq, -1)
        for start, length in runs.tolist():
            pos = start
            while length:
                take = min(length, per_slot - cur_n)
                pid = -1
                if ci >= 0:
                    pid = len(pieces)
                    pieces.append((ci, pos * pb, take * pb))
                cur_copies.append((w.payload[pos * pb:(pos + take) * pb], cur_n * pb, pid))
                cur_pages.append(w.pages[pos:pos + take])
                cur_n += take
                pos += take
                length -= take
                if cur_n == per_slot:
                    close_chunk()
    close_chunk()
    crc_only = _uncovered(checks, pieces)
    return StreamedPlan(spec, chunks, missing, copy_bytes, superseded, records, list(checks), pieces, crc_only)


def _uncovered(checks: Sequence[DeferredCheck], pieces: list[tuple[int, int, int]]
               ) -> list[tuple[int, memoryview]]:
    """Pieces for the bytes of each checked record that no copy reads (appended to ``pieces``)."""
    covered: dict[int, list[tuple[int, int]]] = {}
    for ci, off, n in pieces:
        covered.setdefault(ci, []).append((off, n))
    out: list[tuple[int, memoryview]] = []
    for ci, c in enumerate(checks):
        pos = 0
        for off, n in sorted(covered.get(ci, [])) + [(c.data.nbytes, 0)]:
            if off > pos:
                pieces.append((ci, pos, off - pos))
                out.append((len(pieces) - 1, c.data[pos:off]))
            pos = max(pos, off + n)
    return out


def _ascending_run(pages: npt.NDArray[np.int64]) -> bool:
    return len(pages) < 2 or bool((np.diff(pages) == 1).all())


class StreamSink(Protocol):
    """Where a streamed restore's slots go. ``slot(i)``: host slot ``i`` (writable uint8, ``slot_bytes`` long);
    ``put(i, chunk)``: send slot ``i``'s bytes to ``chunk.pages`` (may return before they arrive); ``done(i)``:
    slot ``i`` may be refilled; ``wait(i)``: block until it may; ``finish()``: every put has arrived."""

    slots: int
    slot_bytes: int

    def begin(self, plan: StreamedPlan) -> None: ...

    def slot(self, i: int) -> npt.NDArray[np.uint8]: ...

    def put(self, i: int, chunk: Chunk) -> None: ...

    def done(self, i: int) -> bool: ...

    def wait(self, i: int) -> None: ...

    def finish(self) -> None: ...


VERIFY_STEP = 1 << 20  # checksum then copy this much at a time: the copy reads what the checksum left in cache


def streamed_threads() -> int:
    """Copy threads of a streamed restore: one per core up to 16 (memcpy from the mapped log into pinned slots
    is the host's whole job when the sink verifies on the device)."""
    return max(1, min(16, os.cpu_count() or 1))


def stream_copy_available() -> bool:
    """True when fills can use streaming (non-temporal) stores: the C extension is built."""
    return _ntcopy is not None


def _copy_into(dst: npt.NDArray[np.uint8], src: memoryview, nontemporal: bool) -> None:
    if nontemporal:
        _ntcopy.copy(dst, src)  # GIL released; streaming stores for the body
    else:
        dst[:] = np.frombuffer(src, dtype=np.uint8)  # numpy releases the GIL for the copy


def _fill(slot: npt.NDArray[np.uint8], chunk: Chunk, crcs: list[int] | None, nontemporal: bool = False) -> None:
    for src, off, pid in chunk.copies:
        n = src.nbytes
        if pid < 0 or crcs is None:
            _copy_into(slot[off:off + n], src, nontemporal)
            continue
        crc = 0
        for a in range(0, n, VERIFY_STEP):
            part = src[a:a + VERIFY_STEP]
            crc = crc32c(part, crc, release_gil=True)
            _copy_into(slot[off + a:off + a + part.nbytes], part, nontemporal)
        crcs[pid] = crc


def _crc_only(items: list[tuple[int, memoryview]], crcs: list[int]) -> None:
    for pid, data in items:
        crcs[pid] = crc32c(data, release_gil=data.nbytes >= 32 << 10)


def _first_failed(plan: StreamedPlan, crcs: list[int]) -> DeferredCheck | None:
    """Combine each checked record's piece checksums in payload order; the earliest record that fails."""
    by_check: dict[int, list[tuple[int, int, int]]] = {}
    for pid, (ci, off, n) in enumerate(plan.pieces):
        by_check.setdefault(ci, []).append((off, n, crcs[pid]))
    shifts: dict[int, int] = {}
    failed = []
    for ci, c in enumerate(plan.checks):
        parts = sorted(by_check.get(ci, []))
        if sum(n for _, n, _ in parts) != c.data.nbytes:
            raise AssertionError(f"record {c.record} of epoch {c.epoch}: pieces do not tile its payload")
        crc = 0
        for i, (_, n, pc) in enumerate(parts):
            if i == 0:
                crc = pc
                continue
            op = shifts.get(n)
            if op is None:
                op = shifts[n] = crc32c_shift(n)
            crc = crc32c_combine(crc, pc, n, op)
        if not parts:
            crc = crc32c(b"")
        if crc != c.expected:
            failed.append(c)
    return min(failed, key=lambda c: c.seq) if failed else None


def run_streamed(plan: StreamedPlan, sink: StreamSink, *, threads: int | None = None,
                 pool: Executor | None = None, prefault: int = 0, nontemporal: bool = False,
                 mirror: Callable[[int, int], int | None] | None = None) -> StreamedStats:
    """Stream ``plan`` through ``sink``'s ring; returns when every byte has arrived (``sink.finish()``) and every
    deferred checksum the plan carries passed (``LogCorruptError`` for the earliest record that failed).

    A sink with ``verifies`` true after ``begin`` checksums the copied pieces itself (on the device) and hands
    their CRCs over in ``collect_crcs(crcs)`` after ``finish``; the fills are then plain copies. ``prefault``:
    helper threads that map the chunks' source pages ahead of the copies (``MADV_POPULATE_READ``), so the copy
    threads do not take first-touch page faults on the mapped log.

    ``nontemporal``: the fills write the slots with streaming stores (``_ntcopy.copy``), so the
    host's memory is not read for the slot lines the fill overwrites; ConfigError where the C extension is not
    built.

    ``mirror`` (a sink with ``put_direct`` that checksums on the device, or a plan without
    checks): ``translate(address, nbytes)`` gives a device-readable copy of source bytes (a pinned log mirror,
    cuda/mirror.py) or None; a chunk of one run whose sources all translate is sent from there (``put_direct``
    with the translation), the others through the ring."""
    t0 = time.perf_counter()
    if nontemporal and not stream_copy_available():
        raise ConfigError(f"nontemporal=True needs the C extension _ntcopy ({_NT_WHY}): build it with "
                          "scripts/build_ext.sh, or leave RecoveryOptions.nontemporal off")
    direct_ok = getattr(sink, "put_direct", None) is not None
    if mirror is not None and not direct_ok:
        mirror = None
    workers = max(1, min(threads or streamed_threads(), sink.slots))
    stats = StreamedStats(bytes=plan.copy_bytes, chunks=len(plan.chunks), threads=workers)
    crcs = [0] * len(plan.pieces)
    crc_jobs: list[Future[None]] = []
    own = pool is None and workers > 1 and len(plan.chunks) > 1
    ex: Executor | None = ThreadPoolExecutor(workers, thread_name_prefix="concordia-restore") if own else pool
    faulters: list[threading.Thread] = []
    stop = threading.Event()
    mirrored: _Mirrored | None = None
    try:
        sink.begin(plan)
        on_sink = bool(plan.checks) and bool(getattr(sink, "verifies", False))
        fill_crcs: list[int] | None = None if on_sink else crcs
        stats.extra["verify_on_device"] = float(on_sink)
        stats.extra["nontemporal"] = float(nontemporal)
        chunks = plan.chunks
        if prefault > 0 and len(chunks) > 1:
            faulters = [threading.Thread(target=_prefault, args=(chunks[i::prefault], stop), daemon=True,
                                         name="concordia-prefault") for i in range(prefault)]
            for th in faulters:
                th.start()
        free: deque[int] = deque(range(sink.slots))
        filling: deque[tuple[int, int, Future[None] | None]] = deque()
        sending: deque[int] = deque()
        k = 0
        # direct sends skip the fills, so they need the sink to checksum what lands (or nothing to check)
        if mirror is not None and chunks and (on_sink or not plan.checks):
            mirrored = _Mirrored(chunks, mirror)
        while k < len(chunks) or filling:
            while mirrored is not None and k < len(chunks) and mirrored.ready[k]:
                sink.put_direct(chunks[k], mirror)  # type: ignore[attr-defined]  # from the pinned mirror
                stats.direct_chunks += 1
                mirrored.sent += 1
                k += 1
            while k < len(chunks) and free:
                if mirrored is not None and mirrored.ready[k]:
                    break  # sent directly by the loop above
                s = free.popleft()
                fut = ex.submit(_fill, sink.slot(s), chunks[k], fill_crcs, nontemporal) if ex is not None else None
                if fut is None:
                    _fill(sink.slot(s), chunks[k], fill_crcs, nontemporal)
                filling.append((k, s, fut))
                k += 1
            if k == len(chunks) and plan.crc_only and not crc_jobs:  # superseded bytes: behind the last fill
                crc_jobs = _submit_crc_only(plan.crc_only, crcs, ex, workers)
            if not filling:  # the next chunk goes directly (top of the loop), or every slot is in flight
                if sending and not free:
                    tw = time.perf_counter()
                    sink.wait(sending[0])
                    stats.slot_wait_s += time.perf_counter() - tw
                    free.append(sending.popleft())
                continue
            kk, s, fut = filling.popleft()
            if fut is not None:
                tw = time.perf_counter()
                fut.result()
                stats.fill_wait_s += time.perf_counter() - tw
            sink.put(s, chunks[kk])
            stats.direct_chunks += chunks[kk].run_start >= 0
            sending.append(s)
            while sending and sink.done(sending[0]):
                free.append(sending.popleft())
            if not free and not filling and sending and k < len(chunks):
                tw = time.perf_counter()
                sink.wait(sending[0])
                stats.slot_wait_s += time.perf_counter() - tw
                free.append(sending.popleft())
        if plan.crc_only and not crc_jobs:  # no chunk at all
            crc_jobs = _submit_crc_only(plan.crc_only, crcs, ex, workers)
        tf = time.perf_counter()
        for f in crc_jobs:
            f.result()
        sink.finish()
        stats.finish_s = time.perf_counter() - tf
        if plan.checks:
            tv = time.perf_counter()
            if on_sink:
                stats.extra["device_verified_pieces"] = float(sink.collect_crcs(crcs))  # type: ignore[attr-defined]
                stats.extra["device_crc_tiles"] = float(getattr(sink, "crc_stats", {}).get("tiles", 0))
            bad = _first_failed(plan, crcs)
            stats.extra["verify_combine_s"] = time.perf_counter() - tv
            stats.extra["verified_bytes"] = float(sum(c.data.nbytes for c in plan.checks))
            if bad is not None:
                raise bad.error()
    finally:
        stop.set()
        for th in faulters:
            th.join()
        if mirrored is not None:
            stats.extra.update(mirror_chunks=float(mirrored.sent), mirror_bytes=float(mirrored.nbytes),
                               mirror_plan_s=mirrored.busy_s)
        if own and ex is not None:
            ex.shutdown(wait=True)
    stats.seconds = time.perf_counter() - t0
    return stats


def range_translator(rows: Sequence[tuple[int, int, int, int]]) -> Callable[[int, int], int | None]:
    """``translate(address, nbytes)`` over ``rows`` of (start, end, target, valid): bytes [address, address +
    nbytes) inside one row's [start, end) and below its first ``valid`` bytes are at ``target + (address -
    start)``; anything else is None (not there)."""
    table = sorted(rows)
    starts = [r[0] for r in table]

    def translate(address: int, nbytes: int) -> int | None:
        i = bisect.bisect_right(starts, address) - 1
        if i < 0:
            return None
        lo, hi, target, valid = table[i]
        off = address - lo
        if address + nbytes > hi or off + nbytes > valid:
            return None
        return target + off

    return translate


class _Mirrored:
    """``run_streamed(mirror=...)``: the one-run chunks whose every source range the mirror holds (decided before
    the stream starts: the mirror is attached already)."""

    def __init__(self, chunks: list[Chunk], translate: Callable[[int, int], int | None]) -> None:
        t0 = time.perf_counter()
        self.ready = [False] * len(chunks)
        self.sent = 0
        self.nbytes = 0
        for k, c in enumerate(chunks):
            if c.run_start < 0:
                continue
            ok = True
            n = 0
            for src, _, _ in c.copies:
                if src.nbytes and translate(int(np.frombuffer(src, dtype=np.uint8).ctypes.data), src.nbytes) is None:
                    ok = False
                    break
                n += src.nbytes
            if ok:
                self.ready[k] = True
                self.nbytes += n
        self.busy_s = time.perf_counter() - t0


MADV_POPULATE_READ = 22  # Linux >= 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc: Any = None


def madvise_fn() -> Any:
    """libc's madvise through ctypes (the GIL released for each call), or False where it cannot be loaded."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            fn = lib.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _libc = fn
        except (OSError, AttributeError):
            _libc = False
    return _libc


def populate_read(address: int, nbytes: int) -> bool:
    """Map ``nbytes`` of this process's memory at ``address`` into its page tables (``MADV_POPULATE_READ``, Linux
    >= 5.14; the GIL is released for the call) without reading them; False where that is not possible (an older
    kernel, no libc, a range not mapped): the readers then fault the pages themselves."""
    fn = madvise_fn()
    if not fn:
        return False
    lo = address - address % _PAGE
    return bool(fn(lo, address + nbytes - lo, MADV_POPULATE_READ) == 0)


def _prefault(chunks: Sequence[Chunk], stop: threading.Event) -> None:
    """Map the source pages of ``chunks`` (in order) into this process's page tables; stops at the first
    failure (an older kernel without MADV_POPULATE_READ: the copies then fault the pages themselves)."""
    for c in chunks:
        if stop.is_set():
            return
        for src, _, _ in c.copies:
            if src.nbytes and not populate_read(int(np.frombuffer(src, dtype=np.uint8).ctypes.data), src.nbytes):
                return


def _submit_crc_only(items: list[tuple[int, memoryview]], crcs: list[int], ex: Executor | None,
                     workers: int) -> list[Future[None]]:
    if ex is None:
        _crc_only(items, crcs)
        return []
    return [ex.submit(_crc_only, items[i::workers], crcs) for i in range(workers)]


class HostSink:
    """A sink into a host buffer (``padded``: the region's ``n_pages * page_bytes`` bytes): the reference the
    device sinks are checked against, and a streamed restore for host regions. ``verify=True``: the sink
    checksums each checked piece where it landed (as the device sink does on the GPU), so the fills only copy."""

    def __init__(self, padded: npt.NDArray[np.uint8], page_bytes: int, *, slots: int = 4,
                 slot_bytes: int = 4 << 20, verify: bool = False) -> None:
        self.padded, self.page_bytes = padded, page_bytes
        self.slots, self.slot_bytes = slots, slot_bytes
        self._ring_mem = np.empty((slots, slot_bytes), dtype=np.uint8)  # one block, a slot per row
        self._ring = list(self._ring_mem)
        self.verifies = verify
        self._crcs: dict[int, int] = {}

    def begin(self, plan: StreamedPlan) -> None:
        if plan.unfilled:
            self.padded[:] = 0
        self._crcs = {}

    def slot(self, i: int) -> npt.NDArray[np.uint8]:
        return self._ring[i]

    def put(self, i: int, chunk: Chunk) -> None:
        pb = self.page_bytes
        src = self._ring[i][:chunk.nbytes]
        if chunk.run_start >= 0:
            dst = self.padded[chunk.run_start * pb:chunk.run_start * pb + chunk.nbytes]
            dst[:] = src
        else:
            dst = src  # checked in the slot, before the scatter (the device sink checks its staging twin)
        if self.verifies:
            for data, off, pid in chunk.copies:
                if pid >= 0:
                    self._crcs[pid] = crc32c(dst[off:off + data.nbytes].data)
        if chunk.run_start < 0:
            self.padded.reshape(-1, pb)[chunk.pages] = src.reshape(-1, pb)

    def put_direct(self, chunk: Chunk, translate: Callable[[int, int], int | None]) -> None:
        """A one-run chunk copied straight into place (no slot) from where ``translate`` says a copy of its
        source bytes is (a mirror)."""
        pb = self.page_bytes
        base = chunk.run_start * pb
        for data, off, pid in chunk.copies:
            dst = self.padded[base + off:base + off + data.nbytes]
            if data.nbytes:
                at = translate(int(np.frombuffer(data, dtype=np.uint8).ctypes.data), data.nbytes)
                assert at is not None  # run_streamed sends only chunks whose every range translates
                dst[:] = np.ctypeslib.as_array((ctypes.c_uint8 * data.nbytes).from_address(at))
            if self.verifies and pid >= 0:
                self._crcs[pid] = crc32c(dst.data)

    def collect_crcs(self, crcs: list[int]) -> int:
        for pid, c in self._crcs.items():
            crcs[pid] = c
        return len(self._crcs)

    def done(self, i: int) -> bool:
        return True

    def wait(self, i: int) -> None:
        return None

    def finish(self) -> None:
        return None
