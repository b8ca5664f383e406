"""`concordia log check|inspect|compact DIR`: reports and repairs, Redis `aof-check` style.

Exit codes: 0 the log is fine (or every problem was fixed); 1 problems were found, could not be fixed, or the
command refused (a live writer holds the log, the directory is read-only); 2 usage errors (no such
directory, a file instead of a directory, a directory that holds no log, bad arguments).

Whatever the input, a user sees no traceback: every failure is one line saying what happened and one line
``next step:`` saying what to do. A log that a live process is writing (its LOCK is flock'd) is checked only up
to what is committed: the epoch being written is not a torn tail. ``--fix`` and ``compact`` refuse a live log.
A fix never deletes a committed byte it could give back: what it takes out goes to ``DIR/set-aside/``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from ..core.compaction import compact_offline, last_failure
from ..core.log import DirLock, remove_orphans
from ..core.manifest import MANIFEST_NAME, SEGMENT_RE, Manifest, load_manifest, store_manifest
from ..core.repair import LiveWriter, apply_rebuild, cut_segment, live_writer, plan_rebuild, set_aside
from ..core.replay import ReplayResult, replay
from ..errors import ConcordiaError, LogCorruptError, LogError, LogLockedError
from .output import console, human_bytes

SEGMENT_HEADER_BYTES = 4096


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("log", help="check, inspect and compact a recovery log")
    lsub = p.add_subparsers(dest="log_cmd", required=True)
    c = lsub.add_parser("check", help="verify every committed epoch; --fix cuts a torn or damaged tail and "
                                      "rebuilds a damaged MANIFEST from the segments")
    c.add_argument("dir")
    c.add_argument("--fix", action="store_true",
                   help="cut a torn/damaged tail, rebuild a damaged MANIFEST, remove crash debris")
    c.add_argument("--drop-after-damage", action="store_true",
                   help="with --fix: also cut the log at damage BEFORE the tail (every later epoch is moved to "
                        "DIR/set-aside/ and no longer replayed)")
    c.add_argument("--json", action="store_true")
    i = lsub.add_parser("inspect", help="epochs, regions, dirty pages, bytes and reduction vs a full copy")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.add_argument("--last", type=int, default=20, help="show the last N epochs (default 20; 0 = all)")
    k = lsub.add_parser("compact", help="rewrite base + suffix into a new base (no writer may hold the log)")
    k.add_argument("dir")


# ---------------------------------------------------------------------------------------------- output
def _say(text: Any) -> None:
    """One line of output, never wrapped (a terminal wraps it; a pipe or a log gets it whole)."""
    console().print(text, soft_wrap=True)


def _error(what: str, next_step: str) -> None:
    _say(f"[red]error:[/] {escape(what)}")
    _say(f"  next step: {escape(next_step)}")


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


def _not_writable(path: Path) -> str | None:
    """Why a repair or compaction cannot write ``path`` (a read-only mount, no permission), or None."""
    if os.access(path, os.W_OK):
        return None
    return f"{path} is not writable (a read-only mount or no write permission)"


def run(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    try:
        usage = _usage_problem(path)
        if usage:
            _error(usage, "pass the directory of a recovery log (the one given to Runtime / Session)")
            return 2
        if args.log_cmd == "check":
            return check(path, fix=args.fix, drop_after_damage=args.drop_after_damage, as_json=args.json)
        if args.log_cmd == "inspect":
            return inspect(path, as_json=args.json, last=args.last)
        return compact(path)
    except OSError as e:
        _error(*describe_os_error(e))
        return 1
    except ConcordiaError as e:
        _error(str(e), "run `concordia log check DIR` for a full report")
        return 1
    except Exception as e:  # noqa: BLE001 - the last line of defence: a bug must not print a traceback
        _error(f"internal error in concordia-ft: {type(e).__name__}: {e}",
               "the log was not changed past what was reported; please report this with "
               "`concordia log check DIR --json`")
        return 1


def _usage_problem(path: Path) -> str | None:
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file, not a log directory"
    if not (path / MANIFEST_NAME).exists() and not any(SEGMENT_RE.match(p.name) for p in path.iterdir()):
        return f"{path} is not a recovery log (no {MANIFEST_NAME} and no segment files)"
    return None


# ------------------------------------------------------------------------------------------------ check
@dataclass
class CheckReport:
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


def check(path: Path, *, fix: bool, drop_after_damage: bool = False, as_json: bool = False) -> int:
    """Verify the whole log; with ``fix``, repair what can be repaired. Exit 0 when nothing is left wrong."""
    rep = CheckReport(str(path))
    writer = live_writer(path)
    lock: DirLock | None = None
    if fix and writer is None:
        refused: tuple[str, str] | None = None
        if (ro := _not_writable(path)) is not None:
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
            return _print_check(rep, as_json)
    if fix and writer is not None:
        rep.live = writer
        rep.problems.append(f"the log is being written by {writer.describe()}: --fix does not touch a live log")
        rep.left.append(rep.problems[-1])
        rep.next_step = ("stop that process (close its Runtime) and run `concordia log check DIR --fix` again; "
                         "`concordia log check DIR` without --fix verifies what it has committed meanwhile")
        return _print_check(rep, as_json)
    try:
        rep.live = writer
        _check(path, rep, fix=fix, drop=drop_after_damage)
        if not fix and rep.live is None and (late := live_writer(path)) is not None:
            rep.live = late  # a writer started while this ran: what looked like a tail may be its epoch
            _check(path, rep := CheckReport(str(path), live=late), fix=False, drop=False)
    finally:
        if lock is not None:
            lock.release()
    return _print_check(rep, as_json)


def _print_check(rep: CheckReport, as_json: bool) -> int:
    if as_json:
        print(json.dumps(rep.doc(), indent=1))
    else:
        live = f", being written by {rep.live.describe()}" if rep.live else ""
        _say(f"log {escape(rep.dir)}: outcome [bold]{rep.outcome}[/], last committed epoch {rep.last_epoch}"
                f"{escape(live)}")
        if rep.in_flight:
            _say(f"  note: {escape(rep.in_flight)}")
        for p in rep.problems:
            _say(f"  [yellow]problem:[/] {escape(p)}")
        for f in rep.fixed:
            _say(f"  [green]fixed:[/] {escape(f)}")
        if rep.next_step:
            _say(f"  next step: {escape(rep.next_step)}")
    return 1 if rep.left else 0


def _found(rep: CheckReport, problem: str, *, fix: bool, repair: Any, done: str, next_step: str) -> None:
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
def inspect(path: Path, *, as_json: bool, last: int) -> int:
    writer = live_writer(path)
    try:
        res = replay(path, collect_summaries=True, materialize=False)  # verifies; builds no region image
    except LogCorruptError as e:
        todo = ("run `concordia log check DIR --fix` to rebuild the MANIFEST from the segments"
                if Path(e.path).name == MANIFEST_NAME else "run `concordia log check DIR` for what to do")
        _error(str(e), todo)
        return 1
    except LogError as e:
        _error(str(e), "run `concordia log check DIR` for what to do")
        return 1
    res.close()
    specs = res.specs
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
    if as_json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    _print_inspect(path, doc, specs, rows, writer)
    return 0


def _print_inspect(path: Path, doc: dict[str, Any], specs: Any, rows: list[dict[str, Any]],
                   writer: LiveWriter | None) -> None:
    from rich.table import Table

    live = f", being written by {writer.describe()}" if writer else ""
    _say(f"log {escape(str(path))}: {doc['outcome']}, {doc['n_epochs']} epochs, last {doc['last_epoch']}, "
            f"{human_bytes(doc['log_bytes'])} in {len(doc['segments'])} segment(s){escape(live)}")
    t = Table(title="regions")
    for col in ("name", "kind", "bytes", "page", "pages", "dtype", "shape"):
        t.add_column(col)
    for n, sp in specs.items():
        t.add_row(escape(n), sp.kind.value, human_bytes(sp.nbytes), str(sp.page_bytes), str(sp.n_pages),
                  escape(str(sp.dtype)), escape(str(sp.shape)))
    _say(t)
    t = Table(title=f"epochs (last {len(rows)})")
    for col in ("epoch", "segment", "bytes", "dirty pages", "reduction vs full copy"):
        t.add_column(col, justify="right")
    for r in rows:
        pages = ", ".join(f"{k}:{v}" for k, v in r["pages"].items()) or "-"
        red = f"{r['reduction']:.1f}x" if r["reduction"] else "-"
        t.add_row(str(r["epoch"]) + (" (base)" if r["full"] else ""), r["segment"], human_bytes(r["bytes"]),
                  escape(pages), red)
    _say(t)
    tail = doc["tail"]
    if tail and tail["kind"] == "in-flight":
        _say(f"note: the epoch being written at {tail['segment']}+{tail['offset']} is not committed yet")
    elif tail:
        _say(f"[yellow]tail:[/] {tail['kind']} at {tail['segment']}+{tail['offset']}: {escape(tail['reason'])}")
        _say("  next step: run `concordia log check DIR --fix` to cut it")
    f = doc["last_compaction_failure"]
    if f:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(f.get("time_ns", 0)) / 1e9))
        _say(f"[yellow]last compaction failed[/] at {when} (pid {f.get('pid')}): "
                f"{escape(str(f.get('error')))}: {escape(str(f.get('message')))}")
        _say("  next step: fix the cause; the log is intact (the old segments stay until a compaction succeeds)")


# ---------------------------------------------------------------------------------------------- compact
def compact(path: Path) -> int:
    writer = live_writer(path)
    if writer is not None:
        _error(f"{path} is being written by {writer.describe()}; an offline compaction needs the log to itself",
               "the writer compacts its own log (Runtime.compact(), or by itself past compact_after_bytes); stop "
               "it first to compact offline")
        return 1
    if (ro := _not_writable(path)) is not None:
        _error(f"cannot compact: {ro}", READ_ONLY_STEP)
        return 1
    try:
        r = compact_offline(path)
    except LogLockedError as e:
        _error(str(e), "wait for that process to finish (or stop it), then run `concordia log compact DIR` again")
        return 1
    except LogCorruptError as e:
        todo = ("run `concordia log check DIR --fix` to rebuild the MANIFEST from the segments"
                if Path(e.path).name == MANIFEST_NAME else
                "run `concordia log check DIR` for what to do (compaction never rewrites a damaged log)")
        _error(str(e), todo)
        return 1
    except LogError as e:
        _error(str(e), "run `concordia log check DIR` for what to do")
        return 1
    if not r.compacted:
        _say(f"nothing done: {escape(r.reason)}")
        return 0
    _say(f"compacted {len(r.replaced)} segment(s), {human_bytes(r.bytes_before)} -> base {r.base} "
                    f"({human_bytes(r.bytes_after)}) at epoch {r.epoch} in {r.seconds:.2f} s")
    return 0
