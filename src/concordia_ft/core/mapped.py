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


class MappedSegment:
    """A fixed-capacity segment on tmpfs, mapped MAP_SHARED and faulted in up front. Appends are stores into the
    mapping (memcpy); ``append_placed`` skips the parts the caller already placed there. ``sync`` is a no-op on
    tmpfs (the stores are in the page cache, like a pwrite: a killed process loses nothing that returned)."""

    def __init__(self, path: Path, capacity: int, *, create_with: bytes | None = None, end: int | None = None,
                 register: Registrar | None = None, io: OsCalls = REAL_OS) -> None:
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
            io.fallocate(self._fd, FALLOC_FL_KEEP_SIZE, 0, self.capacity)
            self._map = mmap.mmap(self._fd, self.capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            io.close_quietly(self._fd)
            if create_with is not None:
                io.unlink_quietly(path)
            raise
        self._view = memoryview(self._map)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)  # host address of byte 0 of the file
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
    """Prepares the next segment file (created, preallocated, faulted in, registered) on a background thread,
    under a ``.tmp`` name that ``remove_orphans`` deletes if the process dies first; ``take`` renames it."""

    def __init__(self, directory: Path, capacity: int, register: Registrar | None, *, io: OsCalls = REAL_OS) -> None:
        self._dir, self._capacity, self._register, self._io = directory, capacity, register, io
        self._lock = threading.Lock()
        self._spare: MappedSegment | None = None
        self._thread: threading.Thread | None = None
        self._retiring: list[threading.Thread] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        with self._lock:
            if self._spare is not None or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._make, name="concordia-spare-segment", daemon=True)
            self._thread.start()

    @property
    def capacity(self) -> int:
        return self._capacity

    def grow(self, capacity: int) -> None:
        """Make the spares prepared from now on at least ``capacity`` bytes (a log whose epochs are large: a
        segment then holds several of them, so most epochs do not roll)."""
        with self._lock:
            self._capacity = max(self._capacity, int(capacity))

    def _make(self) -> None:
        path = self._dir / f"spare.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            path.unlink(missing_ok=True)
            with self._lock:
                capacity = self._capacity
            seg = MappedSegment(path, capacity, create_with=b"", register=self._register, io=self._io)
        except BaseException as e:  # noqa: BLE001 - the roll then creates its segment itself
            self.error = e
            with self._lock:
                self._thread = None
            return
        with self._lock:
            self._spare, self._thread = seg, None

    def retire(self, seg: MappedSegment) -> None:
        """Close a sealed segment (driver unregistration, unmap, hole punch of its unused tail) on a background
        thread: a roll does not wait for it (the bytes are synced already; only this process's view goes)."""
        def close() -> None:
            try:
                seg.close(quietly=True)
            except OSError:
                pass  # the file is sealed and synced: nothing of it is at stake

        t = threading.Thread(target=close, name="concordia-retire-segment", daemon=True)
        with self._lock:
            self._retiring = [r for r in self._retiring if r.is_alive()] + [t]
        t.start()

    def take(self, path: Path, header: bytes, capacity: int) -> MappedSegment | None:
        """The prepared segment renamed to ``path`` with ``header`` written, or None when none is ready (or it is
        smaller than ``capacity``)."""
        with self._lock:
            seg, self._spare, making = self._spare, None, self._thread
        if seg is None and making is not None:  # being prepared: finishing it is quicker than starting anew
            making.join()
            with self._lock:
                seg, self._spare = self._spare, None
        if seg is None:
            return None
        if seg.capacity < capacity:
            self._discard(seg)
            return None
        self._io.replace(seg.path, path)
        seg.path = path
        seg.append([header])
        return seg

    def _discard(self, seg: MappedSegment) -> None:
        p = seg.path
        seg.close(quietly=True)
        self._io.unlink_quietly(p)

    def close(self) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout=30)
        for r in self._retiring:
            r.join(timeout=30)
        with self._lock:
            seg, self._spare = self._spare, None
        if seg is not None:
            self._discard(seg)


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
