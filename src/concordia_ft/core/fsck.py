"""Checking a log directory (`concordia log check` and `inspect`, Redis `aof-check` style): the decisions, the
repairs it runs (core/repair.py) and the report of each; the CLI only parses, calls this and prints.

A log that a live process is writing (its LOCK is flock'd) is checked only up to what is committed: the epoch
being written is not a torn tail, and ``fix`` refuses a live log. A fix never deletes a committed byte it
could give back: what it takes out goes to ``DIR/set-aside/``. Every problem comes with one next step.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConcordiaError, LogCorruptError, LogError, LogLockedError
from .compaction import last_failure
from .format import SEGMENT_HEADER_BYTES
from .log import DirLock, remove_orphans
from .manifest import MANIFEST_NAME, SEGMENT_RE, Manifest, load_manifest, store_manifest
from .regions import RegionSpec
from .repair import LiveWriter, apply_rebuild, cut_segment, live_writer, plan_rebuild, set_aside
from .replay import ReplayResult, replay

__all__ = ["READ_ONLY_STEP", "CheckReport", "InspectReport", "check_log", "describe_os_error", "inspect_log",
           "not_writable", "usage_problem"]


def describe_os_error(e: OSError) -> tuple[str, str]:
    """(what happened, what to do) for an OSError met while reading or repairing a log."""
    where = f" ({e.filename})" if e.filename else ""
    what = f"{e.strerror or e}{where}"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return what, READ_ONLY_STEP
    if e.errno == errno.ENOSPC:
        return what, "the disk is full: free space (or move the log) and run the command again"
    return what, "check the device and the directory's permissions, then run the command again"


READ_ONLY_STEP = ("the log directory is not writable here: `concordia log check DIR` and `inspect` still work; copy "
                  "the directory somewhere writable to fix or compact it")


def not_writable(path: Path) -> str | None:
    """Why a repair or compaction cannot write ``path`` (a read-only mount, no permission), or None."""
    if os.access(path, os.W_OK):
        return None
    return f"{path} is not writable (a read-only mount or no write permission)"


def usage_problem(path: Path) -> str | None:
    """Why ``path`` is not a log directory (missing, a file, no MANIFEST and no segment), or None."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file, not a log directory"
    if not (path / MANIFEST_NAME).exists() and not any(SEGMENT_RE.match(p.name) for p in path.iterdir()):
        return f"{path} is not a recovery log (no {MANIFEST_NAME} and no segment files)"
    return None


@dataclass
class CheckReport:
    """What ``check_log`` found and did: the replay's outcome, each problem, what was fixed, what is left, and
    the one next step for an operator."""

    dir: str
    outcome: str | None = None
    last_epoch: int | None = None
    bytes_verified: int = 0
    live: LiveWriter | None = None
    in_flight: str | None = None  # the live writer's epoch being written (not checked)
    problems: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    next_step: str | None = None
    error: str | None = None

    def doc(self) -> dict[str, Any]:
        return {"dir": self.dir, "outcome": self.outcome, "last_epoch": self.last_epoch,
                "bytes_verified": self.bytes_verified,
                "live": None if self.live is None else {"pid": self.live.pid}, "in_flight": self.in_flight,
                "problems": self.problems, "fixed": self.fixed, "left": self.left, "next_step": self.next_step,
                "error": self.error}


def check_log(path: Path, *, fix: bool, drop_after_damage: bool = False) -> CheckReport:
    """Verify the whole log; with ``fix``, repair what can be repaired (``drop_after_damage``: also cut at
    damage before the tail, setting every later epoch aside). Nothing is left wrong when ``report.left`` is
    empty."""
    rep = CheckReport(str(path))
    writer = live_writer(path)
    lock: DirLock | None = None
    if fix and writer is None:
        refused: tuple[str, str] | None = None
        if (ro := not_writable(path)) is not None:
            refused = (ro, READ_ONLY_STEP)
        else:
            try:
                lock = DirLock(path, "repair")
            except LogLockedError:
                writer = live_writer(path) or LiveWriter(None)
            except LogError as e:  # the LOCK file cannot be opened for writing
                refused = (str(e), READ_ONLY_STEP)
            except OSError as e:
                refused = describe_os_error(e)
        if refused is not None:
            rep.problems.append(f"cannot lock the log for a repair: {refused[0]}")
            rep.left.append(rep.problems[-1])
            rep.next_step = refused[1]
            return rep
    if fix and writer is not None:
        rep.live = writer
        rep.problems.append(f"the log is being written by {writer.describe()}: --fix does not touch a live log")
        rep.left.append(rep.problems[-1])
        rep.next_step = ("stop that process (close its Runtime) and run `concordia log check DIR --fix` again; "
                         "`concordia log check DIR` without --fix verifies what it has committed meanwhile")
        return rep
    try:
        rep.live = writer
        _check(path, rep, fix=fix, drop=drop_after_damage)
        if not fix and rep.live is None and (late := live_writer(path)) is not None:
            rep.live = late  # a writer started while this ran: what looked like a tail may be its epoch
            _check(path, rep := CheckReport(str(path), live=late), fix=False, drop=False)
    finally:
        if lock is not None:
            lock.release()
    return rep


def _found(rep: CheckReport, problem: str, *, fix: bool, repair: Callable[[], str] | None, done: str,
           next_step: str) -> None:
    """Record ``problem``; run ``repair`` (a callable returning extra words for ``done``) when fixing."""
    rep.problems.append(problem)
    if fix and repair is not None:
        try:
            extra = repair()
        except OSError as e:  # the disk refused the repair: what is done so far is consistent (each step is)
            what, todo = describe_os_error(e)
            rep.left.append(f"repair failed: {what}")
            rep.problems.append(rep.left[-1])
            rep.next_step = rep.next_step or todo
            return
        except ConcordiaError as e:
            rep.left.append(f"repair failed: {e}")
            rep.problems.append(rep.left[-1])
            rep.next_step = rep.next_step or "run `concordia log check DIR` to see where the log stands"
            return
        rep.fixed.append(done + (f" ({extra})" if extra else ""))
    else:
        rep.left.append(problem)
        rep.next_step = rep.next_step or next_step


def _check(path: Path, rep: CheckReport, *, fix: bool, drop: bool, rebuilt: bool = False) -> None:
    try:
        manifest = load_manifest(path)
        if manifest is None:
            raise LogCorruptError(str(path / MANIFEST_NAME), 0, "the MANIFEST is missing (segment files are there)")
    except LogCorruptError as e:
        rep.outcome = "damaged-manifest"
        _manifest_damage(path, rep, e.reason, fix=fix, drop=drop, rebuilt=rebuilt)
        return
    except LogError as e:  # a newer format version
        rep.outcome, rep.error = "error", str(e)
        _found(rep, str(e), fix=fix, repair=None, done="", next_step="upgrade concordia-ft to read this log")
        return
    try:
        res = replay(path, manifest=manifest, materialize=False)
        res.close()
    except LogCorruptError as e:
        rep.outcome, rep.error = "corrupt", str(e)
        _damage(path, rep, manifest, e, fix=fix, drop=drop)
        return
    except LogError as e:
        rep.outcome, rep.error = "error", str(e)
        _found(rep, str(e), fix=fix, repair=None, done="", next_step="upgrade concordia-ft to read this log")
        return
    rep.outcome, rep.last_epoch, rep.bytes_verified = res.outcome.value, res.epoch, res.bytes_read
    if res.tail is not None:
        _tail(path, rep, res, fix=fix)
    if rep.live is None:
        _debris(path, rep, fix=fix)
    if fix and rep.fixed and not rep.left and not rebuilt:
        after = replay(path, materialize=False)
        after.close()
        rep.outcome, rep.last_epoch = after.outcome.value, after.epoch


def _tail(path: Path, rep: CheckReport, res: ReplayResult, *, fix: bool) -> None:
    t = res.tail
    assert t is not None and res.manifest is not None
    if rep.live is not None and t.segment == res.manifest.segments()[-1]:
        rep.outcome = "ok"
        rep.in_flight = (f"the epoch being written at {t.segment}+{t.offset} is not committed yet and was not "
                         f"checked; the {res.epoch or 0} committed epoch(s) before it verify")
        return
    if t.offset < SEGMENT_HEADER_BYTES:  # the segment's header never finished: it holds nothing
        manifest = res.manifest

        def drop_segment() -> str:
            where = set_aside(path, [t.segment])
            manifest.incr = [n for n in manifest.incr if n != t.segment]
            store_manifest(path, manifest)
            return _kept(where, "its bytes are")

        _found(rep, f"{t.segment} is named in the manifest but its header never finished ({t.size_bytes} bytes)",
               fix=fix, repair=drop_segment, done=f"took {t.segment} out of the manifest",
               next_step="run `concordia log check DIR --fix` to take it out of the manifest (it holds no epoch)")
        return
    damaged = t.kind.value == "damaged"
    what = ("whole but failing its checks (media damage or a lost write): that epoch is lost" if damaged
            else "an unfinished write: that epoch never committed")
    _found(rep, f"{t.kind.value} tail in {t.segment} at offset {t.offset} ({t.size_bytes} bytes): {t.reason}",
           fix=fix, repair=lambda: _kept(cut_segment(path, t.segment, t.offset, keep_cut_bytes=damaged), "the cut bytes are"),
           done=f"cut {t.size_bytes} bytes from {t.segment} at {t.offset}",
           next_step=f"run `concordia log check DIR --fix` to cut it ({what}; epochs up to {res.epoch} stay)")


def _kept(where: Path | None, what: str = "the cut bytes") -> str:
    return f"{what} kept in {where}" if where else ""


def _debris(path: Path, rep: CheckReport, *, fix: bool) -> None:
    m = load_manifest(path)
    if m is None:
        return
    keep = set(m.segments())
    orphans = sorted(p.name for p in path.iterdir()
                     if p.is_file() and ((SEGMENT_RE.match(p.name) and p.name not in keep) or p.name.endswith(".tmp")))
    if orphans:
        _found(rep, f"crash debris (not in the manifest): {', '.join(orphans)}", fix=fix,
               repair=lambda: f"{len(remove_orphans(path, m))} file(s)", done="removed crash debris",
               next_step="run `concordia log check DIR --fix` to remove it (a writer opening the log does too)")


def _manifest_damage(path: Path, rep: CheckReport, reason: str, *, fix: bool, drop: bool, rebuilt: bool) -> None:
    if rebuilt:  # the manifest just written does not read back: stop rather than loop
        rep.problems.append(f"the rebuilt MANIFEST does not read back: {reason}")
        rep.left.append(rep.problems[-1])
        rep.next_step = "the directory is not storing what is written to it: check the device"
        return
    plan = plan_rebuild(path)
    if plan.manifest is None:
        _found(rep, f"MANIFEST: {reason}; {plan.describe()}", fix=fix, repair=None, done="",
               next_step="restore the log from a replica (no segment here holds a committed epoch that verifies)")
        return
    _found(rep, f"MANIFEST: {reason}", fix=fix,
           repair=lambda: _kept(apply_rebuild(path, plan), "the old MANIFEST and the files left out are"), done=f"rebuilt the MANIFEST: {plan.describe()}",
           next_step=f"run `concordia log check DIR --fix` to rebuild it from the segments ({plan.describe()})")
    if fix:
        after = CheckReport(rep.dir, live=rep.live)
        _check(path, after, fix=fix, drop=drop, rebuilt=True)
        rep.outcome, rep.last_epoch, rep.bytes_verified = after.outcome, after.last_epoch, after.bytes_verified
        rep.in_flight = after.in_flight
        rep.problems += after.problems
        rep.fixed += after.fixed
        rep.left += after.left
        rep.next_step = after.next_step or rep.next_step


def _damage(path: Path, rep: CheckReport, manifest: Manifest, e: LogCorruptError, *, fix: bool, drop: bool) -> None:
    """Damage before the tail: only --drop-after-damage repairs it (the operator gives up the later epochs)."""
    seg = Path(e.path).name
    names = manifest.segments()
    if seg not in names:  # not a segment of this log (cannot happen with a readable manifest): report only
        _found(rep, str(e), fix=fix, repair=None, done="", next_step="run `concordia log check DIR --json`")
        return
    missing = "missing" in e.reason and not (path / seg).exists()
    if missing:
        plan = plan_rebuild(path, log_id=manifest.log_id)
        if plan.manifest is None:
            _found(rep, str(e), fix=fix, repair=None, done="",
                   next_step=f"restore {seg} from a replica: no layout of the remaining segments verifies")
            return
        last = seg == names[-1]
        allowed = drop or last
        _found(rep, f"{seg} is named in the manifest but missing", fix=fix and allowed,
               repair=lambda: _kept(apply_rebuild(path, plan), "the old MANIFEST and the files left out are"), done=f"rebuilt the MANIFEST: {plan.describe()}",
               next_step=(f"restore {seg} from a replica, or run `concordia log check DIR --fix"
                          f"{'' if last else ' --drop-after-damage'}` to rebuild the manifest without it "
                          f"({plan.describe()})"))
        if fix and not allowed:
            rep.next_step = (f"restore {seg} from a replica, or rerun with --fix --drop-after-damage to rebuild the "
                             f"manifest without it ({plan.describe()})")
        return
    later = names[names.index(seg) + 1 :]
    cut_at = 0 if e.offset <= SEGMENT_HEADER_BYTES else e.offset

    def repair() -> str:
        moved = set_aside(path, later)
        kept = None
        if cut_at == 0:  # its header is damaged: the whole segment goes
            moved = set_aside(path, [seg]) or moved
            gone = [seg, *later]
        else:
            kept = cut_segment(path, seg, cut_at, keep_cut_bytes=True)
            gone = later
        manifest.incr = [n for n in manifest.incr if n not in gone]
        if manifest.base in gone:
            manifest.base = None
        store_manifest(path, manifest)
        where = kept.parent if kept else moved
        return f"what was cut or dropped is kept in {where}" if where else ""

    what = (f"cut {seg} at offset {cut_at}" if cut_at else f"dropped {seg} (its header is damaged)") + \
        (f" and dropped {len(later)} later segment(s)" if later else "")
    _found(rep, str(e), fix=fix and drop, repair=repair, done=what,
           next_step=(f"restore {seg} from a replica if you have one; otherwise run `concordia log check DIR --fix "
                      f"--drop-after-damage` to keep only the epochs before offset {e.offset} of {seg} (every later "
                      "epoch is moved to DIR/set-aside/ and no longer replayed)"))


# ---------------------------------------------------------------------------------------------- inspect
@dataclass
class InspectReport:
    """``inspect_log``'s answer: ``doc`` (what `--json` prints), the regions' specs and the epochs' rows."""

    doc: dict[str, Any]
    specs: dict[str, RegionSpec]
    rows: list[dict[str, Any]]
    writer: LiveWriter | None


def inspect_log(path: Path, *, last: int = 20) -> InspectReport:
    """Verify the log (payload checksums included, no region image built) and describe it: its regions as of
    the last committed epoch, the ``last`` newest epochs (0: all) with their dirty pages and the reduction
    against a full copy, the tail, a live writer, the last compaction failure. Raises LogCorruptError or
    LogError when the log does not replay."""
    writer = live_writer(path)
    res = replay(path, collect_summaries=True, materialize=False)
    try:
        specs = dict(res.specs)  # the replay state: read before close() releases it
    finally:
        res.close()
    epochs = res.epochs[-last:] if last else res.epochs
    rows = [{"epoch": s.epoch, "segment": s.segment, "offset": s.offset, "bytes": s.total_bytes,
             "payload_bytes": s.payload_bytes, "full": s.full, "pages": s.pages,
             "reduction": (s.region_bytes / s.payload_bytes) if s.payload_bytes else None} for s in epochs]
    total = sum(s.total_bytes for s in res.epochs)
    tail = res.tail
    in_flight = (writer is not None and tail is not None and res.manifest is not None
                 and tail.segment == res.manifest.segments()[-1])
    failure = last_failure(path)
    doc = {"dir": str(path), "outcome": "ok" if in_flight else res.outcome.value, "last_epoch": res.epoch,
           "n_epochs": len(res.epochs), "log_bytes": total,
           "segments": res.manifest.segments() if res.manifest else [],
           "regions": [{"name": n, **sp.describe()} for n, sp in specs.items()], "meta": res.meta, "epochs": rows,
           "live": None if writer is None else {"pid": writer.pid},
           "tail": None if tail is None else {"segment": tail.segment, "offset": tail.offset,
                                              "kind": "in-flight" if in_flight else tail.kind.value,
                                              "reason": tail.reason},
           "last_compaction_failure": failure}
    return InspectReport(doc, specs, rows, writer)


