"""`concordia log check|inspect|compact DIR`: reports and repairs, Redis `aof-check` style.

Exit codes: 0 the log is fine, 1 problems were found (or could not be fixed), 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ..core.compaction import compact_offline
from ..core.log import DirLock, remove_orphans
from ..core.manifest import SEGMENT_RE, load_manifest, store_manifest
from ..core.replay import replay
from ..errors import ConcordiaError, LogCorruptError
from .output import console, human_bytes


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("log", help="check, inspect and compact a recovery log")
    lsub = p.add_subparsers(dest="log_cmd", required=True)
    c = lsub.add_parser("check", help="verify every epoch's checksums; --fix cuts a torn or damaged tail")
    c.add_argument("dir")
    c.add_argument("--fix", action="store_true", help="cut a torn/damaged tail and remove crash debris")
    c.add_argument("--drop-after-damage", action="store_true",
                   help="with --fix: also cut the log at damage BEFORE the tail (loses every later epoch)")
    c.add_argument("--json", action="store_true")
    i = lsub.add_parser("inspect", help="epochs, regions, dirty pages, bytes and reduction vs a full copy")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.add_argument("--last", type=int, default=20, help="show the last N epochs (default 20; 0 = all)")
    k = lsub.add_parser("compact", help="rewrite base + suffix into a new base (no writer may hold the log)")
    k.add_argument("dir")


def run(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    if not path.is_dir():
        console().print(f"[red]error:[/] {path} is not a directory")
        return 2
    if args.log_cmd == "check":
        return check(path, fix=args.fix, drop_after_damage=args.drop_after_damage, as_json=args.json)
    if args.log_cmd == "inspect":
        return inspect(path, as_json=args.json, last=args.last)
    return compact(path)


def _orphans(path: Path) -> list[str]:
    m = load_manifest(path)
    if m is None:
        return []
    keep = set(m.segments())
    return sorted(p.name for p in path.iterdir()
                  if (SEGMENT_RE.match(p.name) and p.name not in keep) or p.name.endswith(".tmp"))


def check(path: Path, *, fix: bool, drop_after_damage: bool = False, as_json: bool = False) -> int:
    """Verify the whole log; with ``fix``, repair what can be repaired. Exit 0 when nothing is left wrong."""
    report: dict[str, Any] = {"dir": str(path), "outcome": None, "last_epoch": None}
    problems: list[str] = []
    fixed: list[str] = []
    left: list[str] = []  # problems still there after this run

    def found(problem: str, repair: Any = None, done: str = "") -> None:
        problems.append(problem)
        if fix and repair is not None:
            repair()
            fixed.append(done)
        else:
            left.append(problem)

    try:
        res = replay(path)
        report.update(outcome=res.outcome.value, last_epoch=res.epoch, bytes_verified=res.bytes_read)
        if res.tail is not None:
            t = res.tail
            found(f"{t.kind.value} tail in {t.segment} at offset {t.offset} ({t.size_bytes} bytes): {t.reason}",
                  lambda: _cut(path, t.segment, t.offset), f"cut {t.size_bytes} bytes from {t.segment} at {t.offset}")
    except LogCorruptError as e:
        report.update(outcome="corrupt", error=str(e))
        seg, offset = Path(e.path).name, e.offset
        repair = (lambda: _cut(path, seg, offset, drop_later=True)) if drop_after_damage else None
        found(str(e), repair, f"cut {seg} at offset {offset} and dropped every later segment")
        if fix and not drop_after_damage:
            left.append("not fixed: damage before the tail; rerun with --fix --drop-after-damage to keep only the "
                        "epochs before it (every later epoch is lost)")
    except (ConcordiaError, OSError) as e:
        report.update(outcome="error", error=str(e))
        found(str(e))
    orphans = _orphans(path) if report["outcome"] != "error" else []
    if orphans:
        m = load_manifest(path)
        found(f"crash debris (not in the manifest): {', '.join(orphans)}",
              (lambda: with_lock(path, lambda: remove_orphans(path, m))) if m else None,
              f"removed {len(orphans)} orphan file(s)")
    report.update(problems=problems, fixed=fixed, left=left)
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        c = console()
        c.print(f"log {path}: outcome [bold]{report['outcome']}[/], last committed epoch {report['last_epoch']}")
        for p in problems:
            c.print(f"  [yellow]problem:[/] {p}")
        for f in fixed:
            c.print(f"  [green]fixed:[/] {f}")
        if left and not fix:
            c.print("  run `concordia log check DIR --fix` to cut a torn/damaged tail and remove crash debris")
    return 1 if left else 0


def with_lock(path: Path, fn: Any) -> Any:
    lock = DirLock(path, "repair")
    try:
        return fn()
    finally:
        lock.release()


def _cut(path: Path, segment: str, offset: int, *, drop_later: bool = False) -> None:
    def do() -> None:
        with open(path / segment, "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())
        if drop_later:
            m = load_manifest(path)
            assert m is not None
            names = m.segments()
            keep = names[: names.index(segment) + 1]
            if m.base and m.base not in keep:
                m.base = None
            m.incr = [n for n in keep if n != m.base]
            store_manifest(path, m)
            for n in names[len(keep):]:
                (path / n).unlink(missing_ok=True)

    with_lock(path, do)


def inspect(path: Path, *, as_json: bool, last: int) -> int:
    try:
        res = replay(path, collect_summaries=True)
    except ConcordiaError as e:
        console().print(f"[red]error:[/] {e}")
        return 1
    epochs = res.epochs[-last:] if last else res.epochs
    regions = [{"name": n, **img.spec.describe()} for n, img in res.regions.items()]
    rows = [{"epoch": s.epoch, "segment": s.segment, "offset": s.offset, "bytes": s.total_bytes,
             "payload_bytes": s.payload_bytes, "full": s.full, "pages": s.pages,
             "reduction": (s.region_bytes / s.payload_bytes) if s.payload_bytes else None} for s in epochs]
    total = sum(s.total_bytes for s in res.epochs)
    doc = {"dir": str(path), "outcome": res.outcome.value, "last_epoch": res.epoch, "n_epochs": len(res.epochs),
           "log_bytes": total, "segments": res.manifest.segments() if res.manifest else [], "regions": regions,
           "meta": res.meta, "epochs": rows,
           "tail": None if res.tail is None else {"segment": res.tail.segment, "offset": res.tail.offset,
                                                   "kind": res.tail.kind.value, "reason": res.tail.reason}}
    if as_json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    from rich.table import Table

    c = console()
    c.print(f"log {path}: {res.outcome.value}, {len(res.epochs)} epochs, last {res.epoch}, "
            f"{human_bytes(total)} in {len(doc['segments'])} segment(s)")
    t = Table(title="regions")
    for col in ("name", "kind", "bytes", "page", "pages", "dtype", "shape"):
        t.add_column(col)
    for n, img in res.regions.items():
        sp = img.spec
        t.add_row(n, sp.kind.value, human_bytes(sp.nbytes), str(sp.page_bytes), str(sp.n_pages), sp.dtype, str(sp.shape))
    c.print(t)
    t = Table(title=f"epochs (last {len(rows)})")
    for col in ("epoch", "segment", "bytes", "dirty pages", "reduction vs full copy"):
        t.add_column(col, justify="right")
    for r in rows:
        pages = ", ".join(f"{k}:{v}" for k, v in r["pages"].items()) or "-"
        red = f"{r['reduction']:.1f}x" if r["reduction"] else "-"
        t.add_row(str(r["epoch"]) + (" (base)" if r["full"] else ""), r["segment"], human_bytes(r["bytes"]), pages, red)
    c.print(t)
    if res.tail:
        c.print(f"[yellow]tail:[/] {res.tail.kind.value} at {res.tail.segment}+{res.tail.offset}: {res.tail.reason}")
    return 0


def compact(path: Path) -> int:
    try:
        r = compact_offline(path)
    except ConcordiaError as e:
        console().print(f"[red]error:[/] {e}")
        return 1
    if not r.compacted:
        console().print(f"nothing done: {r.reason}")
        return 0
    console().print(f"compacted {len(r.replaced)} segment(s), {human_bytes(r.bytes_before)} -> base {r.base} "
                    f"({human_bytes(r.bytes_after)}) at epoch {r.epoch} in {r.seconds:.2f} s")
    return 0

