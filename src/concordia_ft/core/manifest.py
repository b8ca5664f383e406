"""The manifest: which segments make up the log, replaced atomically (temp, fsync, rename, fsync dir).

``MANIFEST`` is a small JSON document followed by a line holding its CRC32C, so a damaged manifest is caught
instead of being half-understood:

    {"format": 1, "log_id": "...", "next_generation": 7, "base": "base.000005.cft", "incr": ["incr.000006.cft"]}
    crc32c 1a2b3c4d
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LogCorruptError, LogError
from .checksums import crc32c
from .format import FORMAT_VERSION
from .oscalls import REAL_OS, OsCalls

MANIFEST_NAME = "MANIFEST"
MAX_MANIFEST_BYTES = 1 << 20
REBUILD_HINT = ("the manifest is damaged (the segments may be intact): run `concordia log check DIR --fix` to "
                "rebuild it from the segments that verify")
SEGMENT_RE = re.compile(r"^(base|incr)\.(\d{6,12})\.cft$")


@dataclass
class Manifest:
    log_id: str
    next_generation: int = 1
    base: str | None = None
    incr: list[str] = field(default_factory=list)

    def copy(self) -> Manifest:
        return Manifest(self.log_id, self.next_generation, self.base, list(self.incr))

    def segments(self) -> list[str]:
        return ([self.base] if self.base else []) + list(self.incr)

    def new_segment_name(self, kind: str) -> str:
        name = f"{kind}.{self.next_generation:06d}.cft"
        self.next_generation += 1
        return name

    def encode(self) -> bytes:
        body = json.dumps(
            {"format": FORMAT_VERSION, "log_id": self.log_id, "next_generation": self.next_generation,
             "base": self.base, "incr": self.incr},
            sort_keys=True,
        ).encode()
        return body + b"\ncrc32c %08x\n" % crc32c(body)


def decode_manifest(data: bytes, path: str) -> Manifest:
    body, sep, tail = data.rpartition(b"\ncrc32c ")
    if not sep:
        raise LogCorruptError(path, 0, "manifest has no checksum line",
                              "the manifest is damaged (the segments may be intact): run `concordia log check DIR --fix` "
                              "to rebuild it from the segments that verify")
    try:
        want = int(tail.strip(), 16)
    except ValueError:
        raise LogCorruptError(path, len(body), "manifest checksum line is unreadable",
                              "run `concordia log check DIR --fix` to rebuild it from the segments that verify"
                              ) from None
    if crc32c(body) != want:
        raise LogCorruptError(path, 0, "manifest checksum mismatch",
                              "the manifest is damaged (the segments may be intact): run `concordia log check DIR --fix` "
                              "to rebuild it from the segments that verify")
    try:
        doc = json.loads(body)
        version = int(doc["format"])
        if version != FORMAT_VERSION:
            raise LogError(f"{path}: log format version {version} is not supported (this build reads "
                           f"{FORMAT_VERSION}); upgrade concordia-ft")
        m = Manifest(log_id=str(doc["log_id"]), next_generation=int(doc["next_generation"]),
                     base=doc["base"], incr=[str(x) for x in doc["incr"]])
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, LogError):
            raise
        raise LogCorruptError(path, 0, f"manifest fields are malformed ({e})", REBUILD_HINT) from None
    for name in m.segments():
        if not isinstance(name, str) or not SEGMENT_RE.match(name):
            raise LogCorruptError(path, 0, f"manifest names a segment {name!r} that is not a segment file name",
                                  REBUILD_HINT)
    return m


def load_manifest(log_dir: Path) -> Manifest | None:
    path = log_dir / MANIFEST_NAME
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_MANIFEST_BYTES:
        raise LogCorruptError(str(path), MAX_MANIFEST_BYTES, "manifest is larger than 1 MiB", REBUILD_HINT)
    return decode_manifest(data, str(path))


class DirSyncError(OSError):
    """The rename of an atomic replace happened, but fsyncing the directory after it failed: the new file is
    in place for this machine, and whether the rename survives a crash is unknown."""


def fsync_dir(path: Path, *, io: OsCalls = REAL_OS) -> None:
    io.fsync_dir(path)


def write_atomically(path: Path, data: bytes, *, sync: bool = True, io: OsCalls = REAL_OS) -> None:
    """temp file, fsync, rename over ``path``, fsync the directory.

    A failure before the rename leaves ``path`` as it was (the temp file is removed when it can be) and
    raises the ``OSError``; a failed directory fsync after it raises ``DirSyncError``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = io.write(fd, view)
                view = view[n:]
            if sync:
                io.fsync(fd)
        except BaseException:
            io.close_quietly(fd)
            raise
        io.close(fd)  # on some filesystems (NFS) close reports a failed write
        io.replace(tmp, path)
    except BaseException:
        io.unlink_quietly(tmp)
        raise
    if sync:
        try:
            io.fsync_dir(path.parent)
        except OSError as e:
            raise DirSyncError(e.errno, e.strerror, str(path.parent)) from e


def store_manifest(log_dir: Path, manifest: Manifest, *, sync: bool = True, io: OsCalls = REAL_OS) -> None:
    write_atomically(log_dir / MANIFEST_NAME, manifest.encode(), sync=sync, io=io)
