"""Compaction: base + sealed suffix -> a new base snapshot (one full epoch), swapped in atomically.

Crash safety, step by step (a crash anywhere leaves a log that replays to the same state):
1. the writer seals its active segment (new appends go to a fresh one, named in the manifest first);
2. the sealed segments are replayed (verified) to their last epoch E;
3. the new base is written to ``base.N.cft.tmp`` (streamed from the mapped segments, zero pages left out:
   snapshot.py), fsynced, renamed to ``base.N.cft``, and the directory
   fsynced: until the manifest names it, it is an orphan that the next open deletes;
4. the manifest is replaced atomically with [new base] + the segments after the sealed ones;
5. the replaced files are deleted (leftovers are orphans, deleted at the next open).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LogCorruptError
from .log import DirLock, RecoveryLog, install_base, remove_orphans, segment_header
from .manifest import MANIFEST_NAME, REBUILD_HINT, SEGMENT_RE, load_manifest, write_atomically
from .oscalls import REAL_OS, OsCalls
from .replay import Outcome, replay
from .snapshot import write_base


@dataclass
class CompactionResult:
    compacted: bool
    epoch: int | None = None
    base: str | None = None
    replaced: tuple[str, ...] = ()
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    reason: str = ""
    seal_seconds: float = 0.0  # of ``seconds``: sealing the active segment (waiting for a lessee's roll or lease end)


FAILURE_NAME = "COMPACTION_FAILED"  # the last compaction failure of this log, until one succeeds


def record_failure(log_dir: Path, error: BaseException, *, io: OsCalls = REAL_OS) -> None:
    """Leave the failure in ``DIR/COMPACTION_FAILED`` (JSON) for `concordia log inspect`; best effort (the
    disk that made the compaction fail may refuse this too)."""
    doc = {"time_ns": time.time_ns(), "pid": os.getpid(), "error": type(error).__name__, "message": str(error)}
    with contextlib.suppress(OSError):
        write_atomically(log_dir / FAILURE_NAME, json.dumps(doc, sort_keys=True).encode(), io=io)


def last_failure(log_dir: Path) -> dict[str, Any] | None:
    """The recorded failure of the last compaction, if the last one failed (None otherwise or unreadable)."""
    try:
        doc = json.loads((log_dir / FAILURE_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def clear_failure(log_dir: Path, *, io: OsCalls = REAL_OS) -> None:
    io.unlink_quietly(log_dir / FAILURE_NAME)


LiveFn = Callable[[Any], "Mapping[str, Any] | None"]


def compact_sealed(log_dir: Path, manifest_segments: list[str], *, new_name: str, header: bytes,
                   install: Callable[[str, list[str]], None],
                   kill_hook: Callable[[str], None] | None = None, io: OsCalls = REAL_OS,
                   live: LiveFn | None = None) -> CompactionResult:
    """Replay (verify) the sealed ``manifest_segments``, write their state as base ``new_name`` (streamed from
    the mapped segments, sparse), and ``install`` it in their place. ``live(meta)``: from the compacted epoch's
    metadata, the pages (ascending int64 arrays) of the regions it names that the state still needs; the rest
    of those regions is dead and left out of the base (None: everything is kept)."""
    t0 = time.perf_counter()
    if not manifest_segments or (len(manifest_segments) == 1 and manifest_segments[0].startswith("base.")):
        return CompactionResult(False, reason="nothing to compact: no sealed incremental segments")
    res = replay(log_dir, segments=manifest_segments, materialize=False)
    try:
        if res.outcome is Outcome.DAMAGED_TAIL:
            assert res.tail is not None
            raise LogCorruptError(str(log_dir / res.tail.segment), res.tail.offset, res.tail.reason,
                                  "compaction refuses to drop a damaged epoch; run `concordia log check DIR --fix`")
        if res.epoch is None or res.pending is None:
            return CompactionResult(False, reason="the sealed segments hold no committed epoch")
        before = sum(os.path.getsize(log_dir / n) for n in manifest_segments)
        keep = live(res.meta) if live is not None else None
        size = write_base(log_dir, new_name, header, res.epoch, res.pending.region_pages(), res.meta,
                          kill_hook=kill_hook, io=io, keep=keep)
    finally:
        res.close()
    if kill_hook:
        kill_hook("before-manifest")
    install(new_name, manifest_segments)
    if kill_hook:
        kill_hook("after-manifest")
    clear_failure(log_dir, io=io)
    return CompactionResult(True, res.epoch, new_name, tuple(manifest_segments), before, size,
                            time.perf_counter() - t0)


def compact_with_writer(writer: RecoveryLog, *, kill_hook: Callable[[str], None] | None = None,
                        live: LiveFn | None = None) -> CompactionResult:
    """Compact while ``writer`` keeps appending (run it in a background thread)."""
    try:
        t0 = time.perf_counter()
        sealed = writer.seal_for_compaction()
        sealed_s = time.perf_counter() - t0
        name, header = writer.reserve_base()
        res = compact_sealed(writer.dir, sealed, new_name=name, header=header, install=writer.install_base,
                             kill_hook=kill_hook, io=writer.io, live=live)
        res.seal_seconds = sealed_s
        res.seconds += sealed_s
        return res
    except Exception as e:
        record_failure(writer.dir, e, io=writer.io)
        raise


def compact_offline(log_dir: str | os.PathLike[str], *, kill_hook: Callable[[str], None] | None = None,
                    io: OsCalls = REAL_OS) -> CompactionResult:
    """Compact a log no process is writing (`concordia log compact DIR`). Takes the directory lock."""
    path = Path(log_dir)
    lock = DirLock(path, "compactor")
    try:
        manifest = load_manifest(path)
        if manifest is None:
            if any(SEGMENT_RE.match(p.name) for p in path.iterdir()):
                raise LogCorruptError(str(path / MANIFEST_NAME), 0, "the MANIFEST is missing (segment files are "
                                      "there)", REBUILD_HINT)
            return CompactionResult(False, reason=f"{path} holds no log (no MANIFEST)")
        remove_orphans(path, manifest)
        segments = manifest.segments()
        name = manifest.new_segment_name("base")
        header = segment_header(manifest, name)

        def install(base: str, replaced: list[str]) -> None:
            install_base(path, manifest, base, replaced, io=io)

        return compact_sealed(path, segments, new_name=name, header=header, install=install, kill_hook=kill_hook,
                              io=io)
    finally:
        lock.release()
