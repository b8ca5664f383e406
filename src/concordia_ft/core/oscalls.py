"""The OS boundary of the log writer: every system call that changes a log directory goes through one table.

Segment files, the manifest and the writer call ``OsCalls`` methods instead of ``os`` directly, so that a test
can hand the writer a table that fails the Nth call with EIO or ENOSPC (tests/faults.py ``FaultyOS``): faults
are injected where they happen, under the log, and every call the writer makes can be one that fails. What a
failure of each call means for the epoch being written and for the log is written up in DESIGN.md ("When a
write or a sync fails").

Readers (replay, ``concordia log check``) never change a log and call ``os`` directly.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

Buffer = bytes | bytearray | memoryview
StrPath = str | os.PathLike[str]

FALLOC_FL_KEEP_SIZE = 1

_libc: ctypes.CDLL | None = None


class OsCalls:
    """The real calls. Subclass and override to inject faults; every method raises ``OSError`` on failure."""

    def open(self, path: StrPath, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def write(self, fd: int, data: Buffer) -> int:
        return os.write(fd, data)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) (Python's os has only posix_fallocate, which cannot keep the size)."""
        global _libc
        try:
            if _libc is None:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
                _libc = lib
            rc = int(_libc.fallocate(fd, mode, offset, length))
        except AttributeError:
            raise OSError(errno.ENOSYS, "fallocate is not available") from None
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def replace(self, src: StrPath, dst: StrPath) -> None:
        os.replace(src, dst)

    def unlink(self, path: StrPath) -> None:
        os.unlink(path)

    def msync(self, mapping: mmap.mmap) -> None:
        mapping.flush()

    # ---- composed from the calls above, so a fault table sees each step
    def fsync_dir(self, path: Path) -> None:
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.fsync(fd)
        finally:
            self.close_quietly(fd)

    def close_quietly(self, fd: int) -> None:
        """Close ``fd`` on a path that is already failing or has nothing to learn from close (Linux releases
        the descriptor even when close reports an error)."""
        try:
            self.close(fd)
        except OSError:
            pass

    def unlink_quietly(self, path: StrPath) -> bool:
        try:
            self.unlink(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False


REAL_OS = OsCalls()
