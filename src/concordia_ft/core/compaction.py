"""Compaction: base + sealed suffix -> a new base snapshot (one full epoch), swapped in atomically.

Crash safety, step by step (a crash anywhere leaves a log that replays to the same state):
1. the writer seals its active segment (new appends go to a fresh one, named in the manifest first);
2. the sealed segments are replayed (verified) to their last epoch E;
3. the new base is written to ``base.N.cft.tmp``, fsynced, renamed to ``base.N.cft``, and the directory
   fsynced: until the manifest names it, it is an orphan that the next open deletes;
4. the manifest is replaced atomically with [new base] + the segments after the sealed ones;
5. the replaced files are deleted (leftovers are orphans, deleted at the next open).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LogCorruptError
from .epochs import plan_epoch
from .log import DirLock, RecoveryLog, install_base, remove_orphans, segment_header
from .manifest import fsync_dir, load_manifest
from .replay import Outcome, RegionImage, replay
from .segment import FileSegment
from .tracking import RegionDelta


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


def _full_delta(img: RegionImage) -> RegionDelta:
    pages = np.arange(img.spec.n_pages, dtype=np.int64)
    return RegionDelta(img.spec, pages, img.padded.data.cast("B"))


def write_base(log_dir: Path, name: str, header: bytes, epoch: int, regions: dict[str, RegionImage],
               meta: object, *, kill_hook: Callable[[str], None] | None = None) -> int:
    """Write ``name`` (via a temp file) holding one full epoch of ``regions``. Returns its size."""
    tmp = log_dir / (name + ".tmp")
    tmp.unlink(missing_ok=True)
    seg = FileSegment(tmp, create_with=header)
    try:
        specs = [img.spec for img in regions.values()]
        plan = plan_epoch(epoch, seg.end, defs=specs, drops=[], deltas=[_full_delta(r) for r in regions.values()],
                          meta=meta, full=True)
        if kill_hook:
            kill_hook("base-writing")
        seg.append(plan.parts)
        seg.sync()
        size = seg.end
    finally:
        seg.close()
    if kill_hook:
        kill_hook("base-written")
    os.replace(tmp, log_dir / name)
    fsync_dir(log_dir)
    return size


def compact_sealed(log_dir: Path, manifest_segments: list[str], *, new_name: str, header: bytes,
                   install: Callable[[str, list[str]], None],
                   kill_hook: Callable[[str], None] | None = None) -> CompactionResult:
    t0 = time.perf_counter()
    if not manifest_segments or (len(manifest_segments) == 1 and manifest_segments[0].startswith("base.")):
        return CompactionResult(False, reason="nothing to compact: no sealed incremental segments")
    before = sum(os.path.getsize(log_dir / n) for n in manifest_segments)
    res = replay(log_dir, segments=manifest_segments)
    if res.outcome is Outcome.DAMAGED_TAIL:
        assert res.tail is not None
        raise LogCorruptError(str(log_dir / res.tail.segment), res.tail.offset, res.tail.reason,
                              "compaction refuses to drop a damaged epoch; run `concordia log check DIR --fix`")
    if res.epoch is None:
        return CompactionResult(False, reason="the sealed segments hold no committed epoch")
    size = write_base(log_dir, new_name, header, res.epoch, res.regions, res.meta, kill_hook=kill_hook)
    if kill_hook:
        kill_hook("before-manifest")
    install(new_name, manifest_segments)
    if kill_hook:
        kill_hook("after-manifest")
    return CompactionResult(True, res.epoch, new_name, tuple(manifest_segments), before, size,
                            time.perf_counter() - t0)


def compact_with_writer(writer: RecoveryLog, *, kill_hook: Callable[[str], None] | None = None
                        ) -> CompactionResult:
    """Compact while ``writer`` keeps appending (run it in a background thread)."""
    sealed = writer.seal_for_compaction()
    name, header = writer.reserve_base()
    return compact_sealed(writer.dir, sealed, new_name=name, header=header, install=writer.install_base,
                          kill_hook=kill_hook)


def compact_offline(log_dir: str | os.PathLike[str], *, kill_hook: Callable[[str], None] | None = None
                    ) -> CompactionResult:
    """Compact a log no process is writing (`concordia log compact DIR`). Takes the directory lock."""
    path = Path(log_dir)
    lock = DirLock(path, "compactor")
    try:
        manifest = load_manifest(path)
        if manifest is None:
            return CompactionResult(False, reason=f"{path} holds no log (no MANIFEST)")
        remove_orphans(path, manifest)
        segments = manifest.segments()
        name = manifest.new_segment_name("base")
        header = segment_header(manifest, name)

        def install(base: str, replaced: list[str]) -> None:
            install_base(path, manifest, base, replaced)

        return compact_sealed(path, segments, new_name=name, header=header, install=install, kill_hook=kill_hook)
    finally:
        lock.release()
