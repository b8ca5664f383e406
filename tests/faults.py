"""Fault injection for a REAL recovery log (imported as ``faults``; llm_helpers' child processes use it too).

``FaultyOS`` sits UNDER the log: it is the writer's table of OS calls (``concordia_ft.core.oscalls.OsCalls``),
making every call for real except the ones it is told to fail, which raise ``OSError`` (EIO, ENOSPC...) the way
the kernel would: a failing pwritev/write may first write part of its bytes, and a failing fdatasync/fsync may
drop what was written since the file's last good sync (``drop_unsynced``: those bytes read back as zeros, as
after the kernel gave up on dirty pages it could not write). Calls are counted from ``arm()`` on, so "the Nth
OS call of a checkpoint" is exact; fallocate (made by the segment's background reserver, at times the scheduler
picks) is not counted and fails only by ``fail_fallocate``.

``FaultyLog`` wraps a ``RecoveryLog`` and hands everything to it, except that ``append`` can be held up (a slow
disk) or refused before a byte is written (what a full disk looks like after ``FileSegment`` cut its partial
write back) for chosen epoch numbers. It records when each append ran, so tests can check the ordering of
asynchronous epochs against the real writer.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from concordia_ft.core.oscalls import Buffer, OsCalls, StrPath
from concordia_ft.errors import LogError

COUNTED = ("open", "close", "pwritev", "write", "fdatasync", "fsync", "ftruncate", "replace", "unlink", "msync")


class FaultyOS(OsCalls):
    def __init__(self) -> None:
        self.calls: list[str] = []  # every counted call since arm(), in order ("pwritev", "fdatasync", ...)
        self.failed: list[tuple[int, str]] = []  # (index in calls, 1-based; op) of each call that failed
        self.fail_fallocate = False
        self.short_writes = False  # every pwritev writes at most half of what it is given (no error)
        self._at: int | None = None
        self._count = 0
        self._errno = errno.EIO
        self._ops: Collection[str] = COUNTED
        self._partial = False
        self._drop = False
        self._unsynced: dict[int, list[tuple[int, int]]] = {}  # fd -> (offset, length) written since its last sync
        self._lock = threading.RLock()

    # ---------------------------------------------------------------------------------------- control
    def arm(self, at: int | None = None, *, count: int = 1, err: int = errno.EIO, ops: Collection[str] = COUNTED,
            partial: bool = False, drop_unsynced: bool = False) -> None:
        """Restart the count; make calls ``at`` .. ``at + count - 1`` (1-based, of kinds ``ops``) fail with
        ``err``. ``at=None``: count only."""
        with self._lock:
            self.calls, self.failed = [], []
            self._at, self._count, self._errno, self._ops = at, count, err, ops
            self._partial, self._drop = partial, drop_unsynced

    def clear(self) -> None:
        """The fault clears: every counted call succeeds from now on (the count goes on)."""
        with self._lock:
            self._at = None

    def _fails(self, op: str) -> bool:
        with self._lock:
            self.calls.append(op)
            n = len(self.calls)
            if self._at is None or op not in self._ops or not self._at <= n < self._at + self._count:
                return False
            self.failed.append((n, op))
            return True

    def _error(self, op: str) -> OSError:
        return OSError(self._errno, f"{os.strerror(self._errno)} (injected into {op})")

    # -------------------------------------------------------------------------------------- the calls
    def open(self, path: StrPath, flags: int, mode: int = 0o644) -> int:
        if self._fails("open"):
            raise self._error("open")
        return super().open(path, flags, mode)

    def close(self, fd: int) -> None:
        fails = self._fails("close")
        self._unsynced.pop(fd, None)
        super().close(fd)  # Linux releases the descriptor even when close reports an error
        if fails:
            raise self._error("close")

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        if self._fails("pwritev"):
            if self._partial:
                self._write_part(fd, views, offset, sum(v.nbytes for v in views) // 2)
            raise self._error("pwritev")
        if self.short_writes:
            total = sum(v.nbytes for v in views)
            if total > 1:
                return self._write_part(fd, views, offset, total // 2)
        n = super().pwritev(fd, views, offset)
        self._note(fd, offset, n)
        return n

    def _write_part(self, fd: int, views: list[memoryview], offset: int, nbytes: int) -> int:
        part: list[memoryview] = []
        left = nbytes
        for v in views:
            if left <= 0:
                break
            part.append(v[:left])
            left -= min(left, v.nbytes)
        n = super().pwritev(fd, part, offset) if part else 0
        self._note(fd, offset, n)
        return n

    def write(self, fd: int, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        pos = os.lseek(fd, 0, os.SEEK_CUR)
        if self._fails("write"):
            if self._partial and view.nbytes > 1:
                self._note(fd, pos, super().write(fd, view[: view.nbytes // 2]))
            raise self._error("write")
        n = super().write(fd, view)
        self._note(fd, pos, n)
        return n

    def _note(self, fd: int, offset: int, n: int) -> None:
        with self._lock:
            self._unsynced.setdefault(fd, []).append((offset, n))

    def fdatasync(self, fd: int) -> None:
        self._sync("fdatasync", fd, super().fdatasync)

    def fsync(self, fd: int) -> None:
        self._sync("fsync", fd, super().fsync)

    def _sync(self, op: str, fd: int, real: Callable[[int], None]) -> None:
        if self._fails(op):
            if self._drop:  # the kernel could not write them and dropped them: they read back as zeros
                size = os.fstat(fd).st_size
                for off, n in self._unsynced.pop(fd, []):
                    if off < size:
                        os.pwrite(fd, bytes(min(n, size - off)), off)
            raise self._error(op)
        real(fd)
        self._unsynced.pop(fd, None)

    def ftruncate(self, fd: int, length: int) -> None:
        if self._fails("ftruncate"):
            raise self._error("ftruncate")
        super().ftruncate(fd, length)
        with self._lock:
            self._unsynced[fd] = [(o, min(n, length - o)) for o, n in self._unsynced.get(fd, []) if o < length]

    def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        if self.fail_fallocate:
            raise OSError(errno.EOPNOTSUPP, f"{os.strerror(errno.EOPNOTSUPP)} (injected into fallocate)")
        super().fallocate(fd, mode, offset, length)

    def replace(self, src: StrPath, dst: StrPath) -> None:
        if self._fails("replace"):
            raise self._error("replace")
        super().replace(src, dst)

    def unlink(self, path: StrPath) -> None:
        if self._fails("unlink"):
            raise self._error("unlink")
        super().unlink(path)

    def msync(self, mapping: mmap.mmap) -> None:
        if self._fails("msync"):
            raise self._error("msync")
        super().msync(mapping)


class FaultyLog:
    def __init__(self, log: Any, *, delay_s: float = 0.0, delay_epochs: Collection[int] | None = None,
                 fail_epochs: Collection[int] = ()) -> None:
        self.inner = log
        self.delay_s = delay_s
        self.delay_epochs = None if delay_epochs is None else set(delay_epochs)
        self.fail_epochs = set(fail_epochs)
        self.appends: list[tuple[int, float, float, bool]] = []  # (epoch, start, end, committed)
        self.max_concurrent = 0
        self._concurrent = 0
        self._lock = threading.Lock()

    def append(self, **kw: Any) -> Any:
        number = (self.inner.last_epoch or 0) + 1
        start = time.perf_counter()
        with self._lock:
            self._concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self._concurrent)
        ok = False
        try:
            if self.delay_s and (self.delay_epochs is None or number in self.delay_epochs):
                time.sleep(self.delay_s)
            if number in self.fail_epochs:
                raise LogError(f"appending epoch {number} to {self.inner.dir} failed: [Errno {errno.ENOSPC}] "
                               f"{os.strerror(errno.ENOSPC)} (injected); nothing of this epoch was committed")
            res = self.inner.append(**kw)
            ok = True
            return res
        finally:
            with self._lock:
                self._concurrent -= 1
            self.appends.append((number, start, time.perf_counter(), ok))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FullDiskForBases(FaultyOS):
    """The log's OS boundary with a disk that is full for a new base: every pwritev into a ``*.cft.tmp``
    (what the compactor writes) fails with ENOSPC while ``full``; the writer's own appends go through."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False
        self.refused = 0
        self._bases: set[int] = set()

    def open(self, path: Any, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        (self._bases.add if str(path).endswith(".cft.tmp") else self._bases.discard)(fd)
        return fd

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        if self.full and fd in self._bases:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)
