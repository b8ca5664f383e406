"""Repairs of a log directory, used by `concordia log check --fix`: finding a live writer, cutting a tail,
rebuilding a lost or damaged MANIFEST from the segments that verify, and setting files aside.

A repair never deletes a committed byte it could still give back: segment files it takes out of the log and
the bytes cut after damage are moved into ``DIR/set-aside/`` (no reader or writer looks there), so an
operator who chose wrong can put them back. Bytes of a torn tail (an epoch that never committed) are cut.

Rebuilding the manifest: every segment header carries the log id and the generation (the number in the file
name), and the first epoch header of a segment says which epoch it starts with. The candidate layouts are
"every incremental segment in generation order" and, for each base, "that base + the incremental segments
that start after its epoch"; each is replayed (verified) and the one that reaches the newest committed epoch
wins (a candidate that fails at a segment is retried without it and everything after it).

Every write a repair makes goes through the log's table of OS calls (``oscalls.OsCalls``, the ``io``
argument), so the I/O fault tests drive repairs the way they drive the writer. The order makes every failure
safe: bytes to be cut are copied aside and made durable (file and directory entries fsynced) before the
segment is truncated; files are moved aside (directory fsynced) before the new manifest is renamed in. A
repair that fails midway leaves a log that replays to the same committed epoch as before, and running it again
finishes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConcordiaError, LogError
from .format import (
    EPOCH_HEADER_BYTES,
    SEGMENT_BASE,
    SEGMENT_HEADER_BYTES,
    EpochHeader,
    FormatError,
    SegmentHeader,
)
from .log import LOCK_NAME
from .manifest import MANIFEST_NAME, SEGMENT_RE, Manifest, store_manifest
from .oscalls import REAL_OS, OsCalls
from .replay import Outcome, replay

SET_ASIDE = "set-aside"


@dataclass(frozen=True)
class LiveWriter:
    """A process holds ``DIR/LOCK``: a Runtime writing the log, or a compactor. ``pid`` None: not written yet."""

    pid: int | None

    def describe(self) -> str:
        return f"pid {self.pid}" if self.pid is not None else "another process (its pid is not written yet)"


def live_writer(log_dir: Path) -> LiveWriter | None:
    """The process that holds the log's LOCK (flock'd by the one writer or compactor), or None.

    Takes no lock that a writer could trip over: a shared flock that fails means an exclusive one is held, and
    one that succeeds is released at once."""
    try:
        fd = os.open(log_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None  # no LOCK file: nothing ever wrote here
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid_text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return LiveWriter(int(pid_text) if pid_text.isdigit() else None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def set_aside_dir(log_dir: Path) -> Path:
    """A new, empty ``DIR/set-aside/TIME[-N]/`` folder."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    (log_dir / SET_ASIDE).mkdir(exist_ok=True)
    for n in range(1000):
        d = log_dir / SET_ASIDE / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise LogError(f"{log_dir / SET_ASIDE} holds 1000 folders of this second; clean it up")


def _new_aside(log_dir: Path, io: OsCalls) -> Path:
    """``set_aside_dir`` whose new entries (``set-aside/`` and ``TIME/``) are durable."""
    dest = set_aside_dir(log_dir)
    io.fsync_dir(log_dir / SET_ASIDE)
    io.fsync_dir(log_dir)
    return dest


def set_aside(log_dir: Path, names: list[str], *, io: OsCalls = REAL_OS) -> Path | None:
    """Move ``names`` (files of the log directory) into a fresh ``set-aside/TIME/`` folder."""
    names = [n for n in names if (log_dir / n).exists()]
    if not names:
        return None
    dest = _new_aside(log_dir, io)
    for n in names:
        io.replace(log_dir / n, dest / n)
    io.fsync_dir(dest)
    io.fsync_dir(log_dir)
    return dest


def _write_file(path: Path, chunks: Iterator[bytes], io: OsCalls) -> None:
    """A new file holding ``chunks``, fsynced, its directory entry too."""
    fd = io.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[io.write(fd, view):]
        io.fsync(fd)
    finally:
        io.close_quietly(fd)
    io.fsync_dir(path.parent)


def _read_chunks(path: Path, offset: int, size: int = 8 << 20) -> Iterator[bytes]:
    with open(path, "rb") as src:
        src.seek(offset)
        while chunk := src.read(size):
            yield chunk


def cut_segment(log_dir: Path, segment: str, offset: int, *, keep_cut_bytes: bool,
                io: OsCalls = REAL_OS) -> Path | None:
    """Truncate ``segment`` at ``offset``; with ``keep_cut_bytes`` the bytes cut go to set-aside first (durably:
    a failure, or a crash, before the cut leaves the segment whole)."""
    path = log_dir / segment
    kept: Path | None = None
    if keep_cut_bytes and path.stat().st_size > offset:
        kept = _new_aside(log_dir, io) / f"{segment}.from-{offset}"
        _write_file(kept, _read_chunks(path, offset), io)
    fd = io.open(path, os.O_RDWR)
    try:
        io.ftruncate(fd, offset)
        io.fsync(fd)
    finally:
        io.close_quietly(fd)
    return kept


@dataclass(frozen=True)
class SegmentFile:
    name: str
    base: bool
    log_id: str
    generation: int
    first_epoch: int | None  # None: no (readable) epoch header after the segment header


@dataclass
class RebuildPlan:
    """What a manifest rebuilt from the segments would hold, and what it would leave out (and why)."""

    manifest: Manifest | None  # None: no segment verifies, nothing to rebuild from
    epoch: int | None = None  # the last committed epoch the rebuilt manifest replays to
    left_out: dict[str, str] = field(default_factory=dict)  # file -> why it is not in the manifest

    def describe(self) -> str:
        if self.manifest is None:
            return "no segment file verifies: there is nothing to rebuild the manifest from"
        segs = ", ".join(self.manifest.segments()) or "no segment"
        out = f"a manifest of {segs} replays to epoch {self.epoch}"
        if self.left_out:
            out += f"; left out (moved to {SET_ASIDE}/): " + "; ".join(f"{n} ({why})" for n, why in self.left_out.items())
        return out


def scan_segments(log_dir: Path) -> tuple[list[SegmentFile], dict[str, str]]:
    """Every segment file whose header verifies, and the others with the reason."""
    found: list[SegmentFile] = []
    bad: dict[str, str] = {}
    for p in sorted(log_dir.iterdir()):
        m = SEGMENT_RE.match(p.name)
        if not m or not p.is_file():
            continue
        try:
            with open(p, "rb") as f:
                head = f.read(SEGMENT_HEADER_BYTES + EPOCH_HEADER_BYTES)
            h = SegmentHeader.decode(head[:SEGMENT_HEADER_BYTES])
        except (OSError, FormatError) as e:
            bad[p.name] = f"unreadable segment header: {e}"
            continue
        if h.generation != int(m.group(2)) or (h.kind == SEGMENT_BASE) != (m.group(1) == "base"):
            bad[p.name] = f"its header says {'base' if h.kind == SEGMENT_BASE else 'incr'} generation {h.generation}"
            continue
        first: int | None = None
        with contextlib.suppress(FormatError):
            first = EpochHeader.decode(head[SEGMENT_HEADER_BYTES:]).epoch
        found.append(SegmentFile(p.name, h.kind == SEGMENT_BASE, h.log_id.hex(), h.generation, first))
    return found, bad


def _candidates(segs: list[SegmentFile]) -> list[list[SegmentFile]]:
    incr = sorted((s for s in segs if not s.base), key=lambda s: s.generation)
    out = [incr] if incr else []
    for b in sorted((s for s in segs if s.base), key=lambda s: -s.generation):
        if b.first_epoch is None:
            continue
        e = b.first_epoch
        out.append([b] + [s for s in incr if s.first_epoch is None or s.first_epoch > e])
    return out


def _verify(log_dir: Path, log_id: str, chain: list[SegmentFile]) -> tuple[int | None, Outcome | None, int]:
    """(last epoch, outcome, how many segments of ``chain`` replay cleanly); retried shorter on damage."""
    while chain:
        m = Manifest(log_id=log_id, base=chain[0].name if chain[0].base else None,
                     incr=[s.name for s in chain if not s.base])
        try:
            res = replay(log_dir, manifest=m, materialize=False)
        except (ConcordiaError, OSError) as e:
            bad = Path(getattr(e, "path", "") or "").name
            names = [s.name for s in chain]
            chain = chain[: names.index(bad)] if bad in names else chain[:-1]
            continue
        res.close()
        return res.epoch, res.outcome, len(chain)
    return None, None, 0


def plan_rebuild(log_dir: Path, *, log_id: str | None = None) -> RebuildPlan:
    """The manifest the segments support (``log_id``: only that log's segments, when known)."""
    segs, bad = scan_segments(log_dir)
    left: dict[str, str] = dict(bad)
    best: tuple[tuple[int, int, int], str, list[SegmentFile], int | None] | None = None
    ids = sorted({s.log_id for s in segs if log_id is None or s.log_id == log_id})
    for lid in ids:
        mine = [s for s in segs if s.log_id == lid]
        for chain in _candidates(mine):
            epoch, outcome, n = _verify(log_dir, lid, chain)
            if not n or epoch is None:
                continue
            score = (epoch, int(outcome is Outcome.OK), -n)
            if best is None or score > best[0]:
                best = (score, lid, chain[:n], epoch)
    if best is None:
        for s in segs:
            left.setdefault(s.name, "no committed epoch verifies in it")
        return RebuildPlan(None, None, left)
    _, lid, chain, epoch = best
    used = {s.name for s in chain}
    for s in segs:
        if s.name in used:
            continue
        if s.log_id != lid:
            left[s.name] = f"it belongs to another log ({s.log_id})"
        else:
            left[s.name] = "not part of the layout that verifies to the newest epoch"
    gens = [s.generation for s in segs] + [int(m.group(2)) for n in left if (m := SEGMENT_RE.match(n))]
    manifest = Manifest(log_id=lid, next_generation=max(gens) + 1, base=chain[0].name if chain[0].base else None,
                        incr=[s.name for s in chain if not s.base])
    return RebuildPlan(manifest, epoch, left)


def apply_rebuild(log_dir: Path, plan: RebuildPlan, *, io: OsCalls = REAL_OS) -> Path | None:
    """Set the old MANIFEST and the files left out aside, then store the rebuilt manifest atomically."""
    if plan.manifest is None:
        raise LogError(f"{log_dir}: {plan.describe()}")
    dest = set_aside(log_dir, list(plan.left_out), io=io)  # first: a writer's next open would delete them as orphans
    old = log_dir / MANIFEST_NAME
    if old.exists():
        if dest is None:
            dest = _new_aside(log_dir, io)
        _write_file(dest / (MANIFEST_NAME + ".damaged"), _read_chunks(old, 0), io)
    store_manifest(log_dir, plan.manifest, io=io)  # atomic: a crash leaves the old manifest or the new one
    return dest
