"""`concordia log check|inspect|compact DIR`: parses, calls core/fsck.py (the checks and repairs) or the
offline compaction, and prints.

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
import json
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from ..core.compaction import compact_offline
from ..core.fsck import (
    READ_ONLY_STEP,
    CheckReport,
    check_log,
    describe_os_error,
    inspect_log,
    not_writable,
    usage_problem,
)
from ..core.manifest import MANIFEST_NAME
from ..core.repair import LiveWriter, live_writer
from ..errors import ConcordiaError, LogCorruptError, LogError, LogLockedError
from .output import console, human_bytes


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


def run(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    try:
        usage = usage_problem(path)
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


# ------------------------------------------------------------------------------------------------ check
def check(path: Path, *, fix: bool, drop_after_damage: bool = False, as_json: bool = False) -> int:
    """Exit 0 when nothing is left wrong."""
    return _print_check(check_log(path, fix=fix, drop_after_damage=drop_after_damage), as_json)


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


# ---------------------------------------------------------------------------------------------- inspect
def inspect(path: Path, *, as_json: bool, last: int) -> int:
    try:
        rep = inspect_log(path, last=last)
    except LogCorruptError as e:
        todo = ("run `concordia log check DIR --fix` to rebuild the MANIFEST from the segments"
                if Path(e.path).name == MANIFEST_NAME else "run `concordia log check DIR` for what to do")
        _error(str(e), todo)
        return 1
    except LogError as e:
        _error(str(e), "run `concordia log check DIR` for what to do")
        return 1
    if as_json:
        print(json.dumps(rep.doc, indent=1, default=str))
        return 0
    _print_inspect(path, rep.doc, rep.specs, rep.rows, rep.writer)
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
    if (ro := not_writable(path)) is not None:
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
