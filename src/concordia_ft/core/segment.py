"""Segment files: appending whole epochs with one vectored write, syncing, cutting, and reading back.

Backends:
- ``file``: an ordinary file; durable after fdatasync.
- ``dram``: the same file code on a tmpfs (/dev/shm): survives the process, not a reboot. Space is reserved
  ahead with fallocate(KEEP_SIZE) so appends copy into pages that already exist (about 3x faster on tmpfs).
- ``dax``: a file on a DAX filesystem mapped with MAP_SYNC; called durable only when the kernel accepts
  MAP_SYNC (then msync makes the CPU stores persistent). Where MAP_SYNC is refused the mapping still works
  but ``durable`` is False and the report says so.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ..errors import ConfigError, LogError
from .oscalls import FALLOC_FL_KEEP_SIZE, REAL_OS, Buffer, OsCalls

IOV_MAX = 1024
PREALLOC_BYTES = 64 << 20
MAX_PREALLOC_BYTES = 512 << 20
_MAP_SHARED_VALIDATE = 0x03
_MAP_SYNC = 0x80000
TMPFS_MAGIC = 0x01021994


def is_tmpfs(path: Path) -> bool:
    """True when ``path`` lives on a tmpfs (statfs magic), i.e. in DRAM."""

    class _Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 120)]

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = _Statfs()
        if libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
            return False
        return bool((buf.f_type & 0xFFFFFFFF) == TMPFS_MAGIC)
    except (OSError, AttributeError):
        return False


class SegmentWriter(Protocol):
    """What the log writer needs of a segment. Every method raises ``OSError`` when the OS call under it
    fails (or ``LogError`` when an epoch cannot fit), and ``end`` then still names the last whole append:
    what the failure means for the epoch and the log is the writer's decision (log.py, DESIGN.md)."""

    path: Path
    end: int
    durable: bool

    def append(self, parts: Sequence[Buffer]) -> int: ...

    def sync(self) -> None: ...

    def cut(self, offset: int) -> None: ...

    def close(self, *, quietly: bool = False) -> None: ...


class FileSegment:
    """Appends with pwritev at the tracked end; ``cut`` takes back what a failed append left past it."""

    def __init__(self, path: Path, *, create_with: bytes | None = None, prealloc: bool = True,
                 io: OsCalls = REAL_OS) -> None:
        self.path = path
        self.durable = True
        self._io = io
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create_with is not None else 0)
        self._fd = io.open(path, flags, 0o644)
        self._prealloc = prealloc
        self._reserved = 0
        self._want = 0
        self._wake = threading.Condition()
        self._reserver: threading.Thread | None = None
        try:
            self.end = os.fstat(self._fd).st_size
            if create_with is not None:
                self.append([create_with])
                self.sync()
        except BaseException:  # a segment that never got its header synced is not created: remove it
            self.close(quietly=True)
            if create_with is not None:
                io.unlink_quietly(path)
            raise

    def _reserve(self, upto: int, epoch_bytes: int = 0) -> None:
        """Keep space reserved past the end (two epochs' worth, 64 MiB to 512 MiB), from a background thread:
        writing into fresh tmpfs pages costs an allocation + zeroing pass, which this takes off the append
        path whenever epochs come further apart than that pass takes."""
        ahead = min(MAX_PREALLOC_BYTES, max(PREALLOC_BYTES, 2 * epoch_bytes))
        if not self._prealloc or upto + ahead // 2 <= self._reserved:
            return
        with self._wake:
            self._want = max(self._want, upto + ahead)
            if self._reserver is None:
                self._reserver = threading.Thread(target=self._reserve_loop, name="concordia-prealloc", daemon=True)
                self._reserver.start()
            self._wake.notify()

    def _reserve_loop(self) -> None:
        while True:
            with self._wake:
                while self._fd >= 0 and self._want <= self._reserved:
                    self._wake.wait()
                if self._fd < 0:
                    return
                start, want, fd = max(self._reserved, self.end), self._want, self._fd
            try:  # a reservation only saves page faults: when it fails (ENOSPC, EOPNOTSUPP), appends go on without
                if want > start:
                    self._io.fallocate(fd, FALLOC_FL_KEEP_SIZE, start, want - start)
                ok = True
            except OSError:
                ok = False
            with self._wake:
                if not ok:
                    self._prealloc = False
                    self._reserver = None
                    return
                self._reserved = max(self._reserved, want)

    def append(self, parts: Sequence[Buffer]) -> int:
        """Write ``parts`` at ``end``; return where they start. On ``OSError`` ``end`` is unchanged and bytes
        past it may have been written (``cut(end)`` removes them)."""
        start = self.end
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(v.nbytes for v in views)
        self._reserve(start + total, total)
        offset = start
        i = 0
        while i < len(views):
            batch = views[i : i + IOV_MAX]
            n = self._io.pwritev(self._fd, batch, offset)
            offset += n
            # a short write: drop what was written from the batch and go on
            while batch and n >= batch[0].nbytes:
                n -= batch[0].nbytes
                batch = batch[1:]
                i += 1
            if batch and n:
                views[i] = batch[0][n:]
        self.end = offset
        return start

    def sync(self) -> None:
        self._io.fdatasync(self._fd)

    def fileno(self) -> int:
        """The file descriptor (an external appender, core/slotlog.py, pwrites through it while leased)."""
        return self._fd

    def cut(self, offset: int) -> None:
        """Truncate to ``offset`` and make the truncation durable (fsync: the size is metadata)."""
        self._io.ftruncate(self._fd, offset)
        self._io.fsync(self._fd)
        self.end = offset
        with self._wake:
            self._reserved = min(self._reserved, offset)

    def close(self, *, quietly: bool = False) -> None:
        with self._wake:
            fd, self._fd = self._fd, -1
            self._wake.notify()
        reserver = self._reserver
        if reserver is not None and reserver is not threading.current_thread():
            reserver.join(timeout=10)
        if fd >= 0:
            if quietly:
                self._io.close_quietly(fd)
            else:
                self._io.close(fd)


class DaxSegment:
    """A fixed-capacity mapped segment. Appends are stores into the mapping; sync is msync."""

    def __init__(self, path: Path, capacity: int, *, create_with: bytes | None = None, end: int | None = None,
                 io: OsCalls = REAL_OS) -> None:
        self.path = path
        self._io = io
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create_with is not None else 0)
        self._fd = io.open(path, flags, 0o644)
        self._map: mmap.mmap | None = None
        self._written = 0  # just past the last byte stored (>= end after a failed sync)
        try:
            size = os.fstat(self._fd).st_size
            if size < capacity:
                io.ftruncate(self._fd, capacity)
            self.capacity = max(size, capacity)
            try:
                self._map = mmap.mmap(self._fd, self.capacity, flags=_MAP_SHARED_VALIDATE | _MAP_SYNC,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self.durable = True
            except OSError:
                self._map = mmap.mmap(self._fd, self.capacity, flags=mmap.MAP_SHARED,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self.durable = False
            self._view = memoryview(self._map)
            self.end = 0 if create_with is not None else (end if end is not None else size)
            if create_with is not None:
                self.append([create_with])
                self.sync()
        except BaseException:
            self.close(quietly=True)
            if create_with is not None:
                io.unlink_quietly(path)
            raise

    def append(self, parts: Sequence[Buffer]) -> int:
        start = self.end
        total = sum(memoryview(p).nbytes for p in parts)
        if start + total > self.capacity:
            raise LogError(f"epoch of {total} bytes does not fit in DAX segment {self.path} "
                           f"({self.capacity - start} bytes left); raise segment_max_bytes")
        off = start
        for p in parts:
            v = memoryview(p).cast("B")
            self._view[off : off + v.nbytes] = v
            off += v.nbytes
            self._written = max(self._written, off)
        self.end = off
        return start

    def sync(self) -> None:
        assert self._map is not None
        self._io.msync(self._map)

    def cut(self, offset: int, written_end: int | None = None) -> None:
        """Zero [offset, written_end) (default: to what was last stored) so no torn bytes outlive the cut."""
        assert self._map is not None
        stop = max(self.end, self._written, written_end or 0)
        self._view[offset:stop] = bytes(stop - offset)
        self._io.msync(self._map)
        self.end = offset
        self._written = offset

    def close(self, *, quietly: bool = False) -> None:
        if self._fd >= 0:
            if self._map is not None:
                self._view.release()
                self._map.close()
                self._map = None
            fd, self._fd = self._fd, -1
            if quietly:
                self._io.close_quietly(fd)
            else:
                self._io.close(fd)


def check_backend(backend: str, log_dir: Path) -> None:
    if backend not in ("file", "dram", "dax"):
        raise ConfigError(f"unknown log backend {backend!r}; use 'file', 'dram' or 'dax'")
    probe = log_dir  # the directory may not exist yet: it is refused before anything is created
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if backend == "dram" and not is_tmpfs(probe):
        raise ConfigError(f"backend 'dram' needs a directory on tmpfs (e.g. /dev/shm/NAME); {log_dir} is not on tmpfs")


def map_segment(fd: int, *, populate: bool = True) -> tuple[mmap.mmap | None, memoryview]:
    """Map an open segment read-only. Returns (mapping or None for an empty file, view).

    ``populate`` faults the whole file in up front (~2x faster for one reader thread); a replay that reads
    the segment on several threads leaves it off, so the faults are taken in parallel by the readers."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None, memoryview(b"")
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    return m, memoryview(m)
