"""Mapped DRAM segments: a preallocated tmpfs segment file mapped MAP_SHARED, so payloads can be DMA'd into
the log's own pages before the epoch's header and commit marker are written.

The file layout is exactly a ``file`` segment's (same header, same epochs); what differs is the order in which
an epoch's bytes reach the file, and that the file is preallocated (its size is the capacity, the unused tail is
zeros, as in a DAX segment):

1. the caller places payloads at the offsets ``plan_epoch`` gives (``placement``): a device DMA into the
   mapping, registered with the driver (``register``), or any host copy;
2. the host computes their CRC32C from the placed bytes, then writes the epoch header + descriptor area;
3. the host writes the commit marker, last.

A crash after 1 leaves payload bytes behind a zero epoch header; after 2, a whole epoch without its marker.
Replay calls both torn (core/epochs.py: the header is never written before its payloads, the marker never
before the rest), and ``RecoveryLog.open`` zeroes the torn bytes before appending again.

``register`` is how the CUDA layer pins the mapping (cuMemHostRegister): core never imports a CUDA binding;
the callable is handed in (``RecoveryLog.set_mapping_registrar``) and applied to every segment the log maps,
including the spare that is prepared ahead (``prepare_spare``) so that creating, faulting in and registering a
new segment happens off the append path.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import LogError
from .oscalls import FALLOC_FL_KEEP_SIZE, REAL_OS, Buffer, OsCalls

FALLOC_FL_PUNCH_HOLE = 2


class Registration(Protocol):
    def close(self) -> None: ...


Registrar = Callable[[int, int], Registration]


def _punch_hole(io: OsCalls, fd: int, offset: int, length: int) -> bool:
    """Deallocate [offset, offset + length) of a tmpfs file (reads as zeros after): cheaper than writing zeros."""
    if length <= 0:
        return True
    try:
        io.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
        return True
    except OSError:
        return False


PREPARE_PIECE = 8 << 20  # a segment prepared beside epochs is allocated and faulted in in pieces of this size


class QuietGate:
    """What keeps the segment worker's heavy work away from a placed epoch: the log holds it from placing the
    payloads to the end of their CRC (``acquire``/``release``), the worker around each piece of a spare's
    preparation and each driver (un)registration (``with gate:``). A waiting epoch goes first: the worker takes
    the gate only while no epoch waits for it, so an epoch waits at most for the one piece in progress."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0

    def acquire(self) -> None:
        self._waiting += 1  # (the GIL makes += atomic enough: a miscount only costs the worker one piece)
        try:
            self._lock.acquire()
        finally:
            self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        while True:
            while self._waiting:
                time.sleep(0.0002)
            self._lock.acquire()
            if not self._waiting:
                return
            self._lock.release()  # an epoch came meanwhile: it goes first

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _NoGate:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_GATE = _NoGate()


def _pieces(nbytes: int, gate: QuietGate | None) -> list[tuple[int, int]]:
    """[(offset, length)]: the whole range at once, or ``PREPARE_PIECE`` pieces when a ``gate`` is given (the
    segment worker's: each piece waits while a placed epoch's DMA and CRC run, and the kernel's mm lock, which a
    long fault-in holds, is given up between pieces -- the CRC's thread creation needs it)."""
    if gate is None or nbytes <= PREPARE_PIECE:
        return [(0, nbytes)]
    return [(o, min(PREPARE_PIECE, nbytes - o)) for o in range(0, nbytes, PREPARE_PIECE)]


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without touching its bytes
_LIBC: Any = None


def populate(address: int, nbytes: int, zero_from: int) -> None:
    """Fault the mapping [address, address + nbytes) in, with the GIL released (ctypes foreign calls release
    it): madvise(MADV_POPULATE_WRITE), or where the kernel refuses that, a memset of the bytes from
    ``zero_from`` on (zeros there already: the preallocated, hole-punched tail); bytes before it are committed
    epochs, left alone (a reopened segment: its pages exist, the first stores take minor faults only)."""
    global _LIBC
    if nbytes <= 0:
        return
    try:
        if _LIBC is None:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.madvise.restype = ctypes.c_int
            _LIBC = lib
        if int(_LIBC.madvise(address, nbytes, MADV_POPULATE_WRITE)) == 0:
            return
    except (OSError, AttributeError):
        pass
    if nbytes > zero_from:
        ctypes.memset(address + zero_from, 0, nbytes - zero_from)


class MappedSegment:
    """A fixed-capacity segment on tmpfs, mapped MAP_SHARED and faulted in up front. Appends are stores into the
    mapping (memcpy); ``append_placed`` skips the parts the caller already placed there. ``sync`` is a no-op on
    tmpfs (the stores are in the page cache, like a pwrite: a killed process loses nothing that returned)."""

    def __init__(self, path: Path, capacity: int, *, create_with: bytes | None = None, end: int | None = None,
                 register: Registrar | None = None, io: OsCalls = REAL_OS,
                 gate: QuietGate | None = None) -> None:
        self.path = path
        self.durable = True  # as durable as a file segment on the same tmpfs
        self._io = io
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create_with is not None else 0)
        self._fd = io.open(path, flags, 0o644)
        try:
            size = os.fstat(self._fd).st_size
            self.end = 0 if create_with is not None else (end if end is not None else size)
            if size > self.end:  # torn or preallocated bytes past the last commit: zeros from here on
                if not _punch_hole(io, self._fd, self.end, size - self.end):
                    io.ftruncate(self._fd, self.end)
            page = mmap.PAGESIZE
            self.capacity = -(-max(capacity, self.end) // page) * page
            if os.fstat(self._fd).st_size < self.capacity:
                io.ftruncate(self._fd, self.capacity)
            # allocate the tmpfs pages now: no page fault on the first store, and a full tmpfs is an ENOSPC here
            # instead of a SIGBUS on a store into a page that cannot be allocated
            for off, n in _pieces(self.capacity, gate):
                with gate or _NO_GATE:
                    io.fallocate(self._fd, FALLOC_FL_KEEP_SIZE, off, n)
            # mapped without MAP_POPULATE: Python's mmap() holds the GIL while the kernel faults every page in
            # (134 ms for 512 MiB), stalling every other thread -- the training loop, the epoch writer -- when the
            # segment worker prepares a spare; the pages are faulted in below with the GIL released
            self._map = mmap.mmap(self._fd, self.capacity, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            io.close_quietly(self._fd)
            if create_with is not None:
                io.unlink_quietly(path)
            raise
        self._view = memoryview(self._map)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)  # host address of byte 0 of the file
        for off, n in _pieces(self.capacity, gate):
            with gate or _NO_GATE:
                populate(self.address + off, n, max(0, self.end - off))
        self._registration: Registration | None = None
        if register is not None:
            self.register(register)
        if create_with is not None:
            self.append([create_with])

    # ---- the driver's view of the mapping ----
    def register(self, register: Registrar) -> None:
        """Pin the mapping with the driver (once): DMA into it then runs at full speed and needs no staging."""
        if self._registration is None:
            self._registration = register(self.address, self.capacity)

    @property
    def registered(self) -> bool:
        return self._registration is not None

    # ---- the SegmentWriter contract ----
    def room(self) -> int:
        return self.capacity - self.end

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Writable bytes [offset, offset + nbytes) of the mapping (where a caller places a payload)."""
        if offset < self.end or offset + nbytes > self.capacity:
            raise LogError(f"placement [{offset}, +{nbytes}) of {self.path} is outside the free space "
                           f"[{self.end}, {self.capacity})")
        return self._view[offset: offset + nbytes]

    def append(self, parts: Sequence[Buffer]) -> int:
        return self.append_placed(parts, ())

    def append_placed(self, parts: Sequence[Buffer], placed: Sequence[int]) -> int:
        """Write ``parts`` in order from the end, skipping the indices in ``placed`` (already in the mapping at
        their offsets); the last part (the commit marker) is stored last."""
        start = self.end
        sizes = [memoryview(p).nbytes for p in parts]
        total = sum(sizes)
        if start + total > self.capacity:
            raise LogError(f"epoch of {total} bytes does not fit in segment {self.path} "
                           f"({self.capacity - start} bytes left)")
        skip = set(placed)
        off = start
        for i, (p, n) in enumerate(zip(parts, sizes, strict=True)):
            if i not in skip and n:
                self._view[off: off + n] = memoryview(p).cast("B")
            off += n
        self.end = off
        return start

    def sync(self) -> None:
        """Nothing to do on tmpfs: the mapping IS the page cache."""

    def cut(self, offset: int, written_end: int | None = None) -> None:
        """Zero [offset, max(end, written_end)) so no torn bytes outlive the cut; the end moves to ``offset``."""
        stop = min(self.capacity, max(self.end, written_end or 0))
        if stop > offset:
            self._view[offset:stop] = bytes(stop - offset)
        self.end = offset

    def close(self, *, quietly: bool = False) -> None:
        if self._fd < 0:
            return
        reg, self._registration = self._registration, None
        try:
            if reg is not None:
                reg.close()
        finally:
            del self._anchor
            self._view.release()
            self._map.close()
            # what was never written past the end is given back to tmpfs (the file reads as zeros there)
            used = -(-self.end // mmap.PAGESIZE) * mmap.PAGESIZE
            _punch_hole(self._io, self._fd, used, self.capacity - used)
            fd, self._fd = self._fd, -1
            if quietly:
                self._io.close_quietly(fd)
            else:
                self._io.close(fd)


class SparePreparer:
    """Prepares the next segment file (created, preallocated, faulted in, registered) off the append path, under
    a ``.tmp`` name that ``remove_orphans`` deletes if the process dies first; ``take`` renames it.

    ONE worker thread, started once, does all of it between epochs. The log reports each epoch's size
    (``after_epoch``, and each roll of a lessee: ``took``); the worker sizes the spares from the sizes seen
    (``target_capacity``), keeps ``depth`` of them ready (created, preallocated, faulted in, registered; more than
    one for a writer whose large epochs come back to back, e.g. a serving engine's prefill chunks, each of which
    fills a segment) and retires sealed segments (driver unregistration, unmap), so a roll on the append path is
    a rename of a ready spare, its header and the manifest: no creation, no page fault, no registration, no
    thread start. Driver (un)registration waits for ``quiet`` (held by the log
    while a placed epoch's DMA is in flight), so it never runs beside one. (A thread per spare and per retired
    segment started by the roll, with two layout passes per placed epoch, committed LoRA's 53 MB epochs in
    3.04 ms median against 2.43 ms this way: integrations/LLM.md, results llm_lora-h200-b1.json.)
    """

    RECENT = 4  # epoch sizes the sizing looks at

    def __init__(self, directory: Path, capacity: int, register: Registrar | None, *, io: OsCalls = REAL_OS,
                 fit_epochs: int = 0, max_capacity: int = 0, header_bytes: int = 4096) -> None:
        self._dir, self._register, self._io = directory, register, io
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ready: list[MappedSegment] = []  # spares ready, oldest first
        self.depth = 1  # spares kept ready
        self.error: BaseException | None = None
        # the worker's state (all under _lock)
        self.quiet = QuietGate()  # held by the log while a placed epoch's DMA and CRC run
        self._base, self._fit, self._header = capacity, fit_epochs, header_bytes
        self._max = max(max_capacity, capacity)
        self._sizes: list[int] = []  # the last epochs' sizes (bytes)
        self._want = capacity  # the capacity the spare should have
        self._making = False
        self._make_failed = False  # a failed make is not retried before the next epoch
        self._to_close: list[tuple[MappedSegment, bool]] = []  # (segment, unlink it): retire or discard
        self._stopping = False
        self._worker: threading.Thread | None = None
        self.stats = {"made": 0, "retired": 0, "discarded": 0, "taken": 0}

    # ---------------------------------------------------------------------------------- sizing
    def target_capacity(self, sizes: Sequence[int]) -> int:
        """The capacity a spare gets after epochs of ``sizes`` bytes (the last few): the configured one, raised
        to hold one typical epoch (the second largest of the last ``RECENT``: a one-off huge epoch, e.g. weights
        logged once, does not count), and, when such epochs are large (over a quarter of the configured
        capacity), ``fit_epochs`` of them, at most ``max_capacity``."""
        cap = self._base
        if len(sizes) < 2:
            return cap
        typical = sorted(sizes)[-2]
        one = typical + 2 * self._header + 8 * 4096  # an epoch planned at another offset pads up to a page more
        if self._fit and typical > self._base // 4:
            cap = max(cap, min(self._fit * (typical + self._header) + self._header, self._max))
        return max(cap, one)

    @property
    def capacity(self) -> int:
        return self._want

    # --------------------------------------------------------------------------------- the worker
    def after_epoch(self, epoch_bytes: int) -> None:
        """An epoch of ``epoch_bytes`` was appended: size the spare for what comes next and have the worker make
        it if the one ready is smaller (or none is)."""
        with self._cond:
            self._sizes = (self._sizes + [int(epoch_bytes)])[-self.RECENT:]
            self._want = self.target_capacity(self._sizes)
            self._make_failed = False
            if self._to_close:
                self._start_worker()
                self._cond.notify_all()
            self._request_make()

    def _request_make(self) -> None:
        """(Under the lock.) Have the worker make a spare if the one ready is smaller than wanted (or none is):
        ``_making`` is set here, by the requester, so a roll right after waits for that spare instead of making
        one of its own before the worker thread got to run."""
        if self._making or self._make_failed or self._stopping:
            return
        if sum(1 for r in self._ready if r.capacity >= self._want) < self.depth:
            self._making = True
            self._start_worker()
            self._cond.notify_all()

    def set_depth(self, depth: int) -> None:
        """Keep ``depth`` spares ready from now on."""
        with self._cond:
            self.depth = max(1, int(depth))
            self._request_make()

    def took(self, epoch_bytes: int) -> None:
        """A roll took a spare for an epoch of ``epoch_bytes`` (a lessee's roll: no ``after_epoch`` follows):
        the next one is made now."""
        self.after_epoch(epoch_bytes)

    def set_registrar(self, register: Registrar) -> None:
        """Pin the spares made from now on (and those ready now) with ``register``."""
        with self._cond:
            self._register = register
            ready = list(self._ready)
        for r in ready:
            with self.quiet:
                r.register(register)

    def _start_worker(self) -> None:
        if self._worker is None and not self._stopping:
            self._worker = threading.Thread(target=self._work, name="concordia-segment-worker", daemon=True)
            self._worker.start()

    def _pending(self) -> bool:
        return bool(self._to_close) or self._making

    def _work(self) -> None:
        try:
            self._work_loop()
        finally:  # stopped (or died): nothing is being made any more, so a roll must not wait for it
            with self._cond:
                self._making = False
                self._worker = None if not self._stopping else self._worker
                self._cond.notify_all()

    def _work_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending():
                    self._cond.wait()
                if self._stopping:
                    break
                closing, self._to_close = self._to_close, []
            for seg, unlink in closing:
                self._close_segment(seg, unlink)
            with self._cond:
                making, want = self._making, self._want
            if making:  # a roll meanwhile waits for this spare (or takes a smaller one still ready that fits)
                self._make_spare(want)
        with self._cond:
            closing, self._to_close = self._to_close, []
        for seg, unlink in closing:
            self._close_segment(seg, unlink)

    def _make_spare(self, capacity: int) -> None:
        """Make a spare of ``capacity`` bytes (``_making`` is set); it replaces a smaller one still ready."""
        seg = None
        try:
            path = self._dir / f"spare.{os.getpid()}.{threading.get_ident()}.{self.stats['made']}.tmp"
            path.unlink(missing_ok=True)
            seg = MappedSegment(path, capacity, create_with=b"", io=self._io, gate=self.quiet)
            if self._register is not None:
                with self.quiet:  # never beside a placed epoch's DMA
                    seg.register(self._register)
            self.stats["made"] += 1
        except BaseException as e:  # noqa: BLE001 - the roll then creates its segment itself
            self.error = e
            if seg is not None:
                self._close_segment(seg, True)
                seg = None
        with self._cond:
            if seg is not None:
                for r in [r for r in self._ready if r.capacity < capacity]:  # smaller ones: replaced
                    self._to_close.append((r, True))
                    self.stats["discarded"] += 1
                self._ready = [r for r in self._ready if r.capacity >= capacity] + [seg]
            self._making = False
            if seg is None:
                self._make_failed = True
            else:
                self._request_make()  # wanted larger meanwhile
            self._cond.notify_all()

    def _close_segment(self, seg: MappedSegment, unlink: bool) -> None:
        p = seg.path
        try:
            if seg.registered:
                with self.quiet:
                    seg.close(quietly=True)
            else:
                seg.close(quietly=True)
        except Exception:  # noqa: BLE001 - a sealed segment is synced already, a spare holds nothing: nothing
            pass  # of it is at stake (an unregistration that fails only leaks this process's pin)
        if unlink:
            self._io.unlink_quietly(p)
        else:
            self.stats["retired"] += 1

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Until the spare being prepared (created, faulted in, registered) is ready, at most ``timeout_s``:
        True when one is ready. A caller that must not have the preparation run beside its work (the serving
        engine, before its first step) waits here, where the time is its own and reported as such."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._making and not self._stopping and self._worker is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return bool(self._ready)

    def stop(self) -> None:
        """Tell the worker to finish (without waiting: ``close`` joins it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def start(self) -> None:
        with self._cond:
            self._request_make()

    def retire(self, seg: MappedSegment) -> None:
        """Close a sealed segment (driver unregistration, unmap, hole punch of its unused tail) off the append
        path: a roll does not wait for it (the bytes are synced already; only this process's view goes)."""
        with self._cond:  # the worker closes it after the epoch that rolled (after_epoch / took)
            self._to_close.append((seg, False))

    def take(self, path: Path, header: bytes, capacity: int) -> MappedSegment | None:
        """The prepared segment renamed to ``path`` with ``header`` written, or None when none is ready (or it is
        smaller than ``capacity``)."""
        with self._cond:
            # one being prepared (and none ready that fits): finishing it beats creating one here
            while self._making and not self._stopping and not any(r.capacity >= capacity for r in self._ready):
                self._cond.wait()
            fit = [r for r in self._ready if r.capacity >= capacity]
            if not fit:
                if self._ready:  # too small for this epoch: discarded by the worker, not here
                    self._to_close += [(r, True) for r in self._ready]
                    self.stats["discarded"] += len(self._ready)
                    self._ready = []
                    self._start_worker()
                    self._cond.notify_all()
                return None
            seg = fit[0]
            self._ready.remove(seg)
            self.stats["taken"] += 1
        self._io.replace(seg.path, path)
        seg.path = path
        seg.append([header])
        return seg

    def _discard(self, seg: MappedSegment) -> None:
        p = seg.path
        seg.close(quietly=True)
        self._io.unlink_quietly(p)

    def close(self) -> None:
        self.stop()
        w = self._worker
        if w is not None and w is not threading.current_thread():
            w.join(timeout=60)
        with self._lock:
            ready, self._ready = self._ready, []
            closing, self._to_close = self._to_close, []
        for s, unlink in closing:
            self._close_segment(s, unlink)
        for r in ready:
            self._discard(r)


class HostPayload:
    """A host buffer as a placed payload: ``place`` copies it into the mapping at the log's offset (the CPU
    counterpart of ``cuda.mapped.DevicePayload``; one memcpy instead of the append's)."""

    def __init__(self, data: Buffer) -> None:
        self._src = memoryview(data).cast("B")
        self.nbytes = self._src.nbytes
        self.placed_at = 0

    def place(self, address: int) -> None:
        if self.nbytes:
            dst = (ctypes.c_char * self.nbytes).from_address(address)
            memoryview(dst).cast("B")[:] = self._src
        self.placed_at = address

    def wait(self) -> None:
        """The copy is done when ``place`` returns."""


def placed_address(seg: Any) -> int | None:
    """Host address of byte 0 of ``seg`` when it accepts placed payloads, else None."""
    return int(seg.address) if isinstance(seg, MappedSegment) else None


__all__ = ["HostPayload", "MappedSegment", "Registrar", "Registration", "SparePreparer", "placed_address"]
