"""Per-phase recovery times of a finished job, from its events and its members' timings (all monotonic ns
of one host, so the coordinator's and the ranks' stamps compare directly).

For each repair: ``detection`` (kill -> the coordinator knows), ``decide`` (-> plan published), ``abort``
(the longest time a survivor spent leaving the broken communicator), ``start`` (a cold standby or a
restart: plan -> the new process has the model), ``restore`` (the replacement's replay of the dead rank's log
into its state), ``rebuild`` (the last member ready -> every member holds the new group), ``first_step``
(-> every member finished the replayed step), ``total`` (kill -> every member finished that step).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FAULTS = "faults.jsonl"


def stamp_fault(job_dir: str | Path, wid: str, what: str, *, by: str, t_ns: int | None = None) -> int:
    """Record that a fault is about to hit process ``wid`` (call it just before the kill): one line appended to
    ``<job_dir>/faults.jsonl`` with one write (O_APPEND: lines from several processes never interleave). Any
    injector stamps here (a rank killing itself, a test or benchmark killing a pid from outside), so every
    repair's detection and total are measured from the fault, whoever sent it. Returns the stamp (monotonic ns:
    one host, so every process's stamps compare)."""
    t = time.monotonic_ns() if t_ns is None else t_ns
    line = json.dumps({"t_ns": t, "wid": wid, "what": what, "by": by}) + "\n"
    fd = os.open(Path(job_dir) / FAULTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return t


def load_faults(job_dir: str | Path) -> list[dict[str, Any]]:
    """Every stamped fault of a job (``stamp_fault``), oldest first; a torn last line is dropped."""
    path = Path(job_dir) / FAULTS
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return sorted(out, key=lambda f: f["t_ns"])


def recovery_phases(repairs: list[dict[str, Any]], timings: dict[int, list[dict[str, Any]]],
                    events: list[dict[str, Any]], faults: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """One row per repair, every repair: the phases its members' timings give. The fault's moment comes from
    the coordinator's own kills (``kill`` events) and from ``faults`` (``load_faults``: any injector's stamps),
    matched by the process the repair replaced; ``sent_by`` says who sent it ("not stamped": a fault nobody
    recorded, e.g. a kill from a shell: detection and total are then unknown, the rest is measured). A repair
    cut short by a later failure before every member's first step has its detection and decision, and
    ``note`` says so."""
    stamps: dict[str, tuple[int, str]] = {}
    for e in events:
        if e["event"] == "kill":
            stamps.setdefault(e["wid"], (int(e["t_kill_ns"]), f"coordinator ({e.get('why', 'kill')})"))
    for f in faults:
        stamps.setdefault(f["wid"], (int(f["t_ns"]), str(f.get("by", "outside"))))
    kills = sorted(e["t_kill_ns"] for e in events if e["event"] == "kill")
    rows = []
    for rec in repairs:
        g = int(rec["gen"])
        members = timings.get(g, [])
        t_det, t_plan = rec["t_detect_ns"], rec["t_plan_ns"]
        t_kill, sent_by = None, "not stamped"
        if "failed_wids" in rec:
            hits = [stamps[w] for w in rec["failed_wids"] if w in stamps and stamps[w][0] <= t_det]
            if hits:
                t_kill, sent_by = max(hits)
        else:  # a result written before repairs named the processes they replaced
            before = [k for k in kills if k <= t_det]
            t_kill, sent_by = (before[-1], "coordinator") if before else (None, sent_by)
        row: dict[str, Any] = {
            "gen": g, "recovery": rec["mode"], "failure": rec["kind"],
            "standby": ",".join(rec.get("standby", {}).values()) or rec["mode"], "cut": rec["cut"],
            "sent_by": sent_by, "detection_ms": (t_det - t_kill) / 1e6 if t_kill is not None else None,
            "decide_ms": (t_plan - t_det) / 1e6, "abort_ms": None, "start_ms": None, "restore_ms": None,
            "rebuild_ms": None, "first_step_ms": None, "total_ms": None, "note": ""}
        if len(members) < len(rec["members"]):
            later = [int(r["gen"]) for r in repairs if int(r["gen"]) > g]
            row["note"] = (f"cut short by the repair of generation {min(later)} before every member's first step"
                           if later else "not every member reported its first step")
            rows.append(row)
            continue
        new = [m for m in members if m["role"] != "survivor"]
        old = [m for m in members if m["role"] == "survivor"]
        ready = max(m["group_ready_ns"] for m in members)
        joined = max([m["restore_end_ns"] for m in new] + [m["plan_seen_ns"] for m in old])
        first = max(m["first_step_end_ns"] for m in members)
        row.update({
            "abort_ms": max((m["abort_ms"] for m in old), default=0.0),
            "start_ms": max(((m["assigned_ns"] - t_plan) / 1e6 for m in new), default=0.0),
            "restore_ms": max((m["restore_ms"] for m in new), default=0.0),
            "rebuild_ms": (ready - joined) / 1e6, "first_step_ms": (first - ready) / 1e6,
            "total_ms": (first - t_kill) / 1e6 if t_kill is not None else None,
            "detect_to_first_step_ms": (first - t_det) / 1e6})
        if rec["mode"] == "restart":
            row["abort_ms"] = (rec["t_abort_end_ns"] - t_det) / 1e6
        rows.append(row)
    return rows


def load_stamps(job_dir: Any) -> dict[str, dict[str, Any]]:
    """Every process's token stamps (``stamps/<wid>.jsonl``: a header line, then one list of [t_ns, request,
    position] per round served), as {wid: {"wid", "rank", "role", "stamps"}}; a torn last line (a process
    killed while writing it) is dropped."""
    d = Path(job_dir) / "stamps"
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(d.glob("*.jsonl")) if d.is_dir() else []:
        lines = f.read_text().splitlines()
        if not lines:
            continue
        doc = {**json.loads(lines[0]), "stamps": []}
        for line in lines[1:]:
            try:
                doc["stamps"] += json.loads(line)
            except json.JSONDecodeError:
                break
        out[f.stem] = doc
    return out


def _new_tokens(stamps: dict[str, dict[str, Any]]) -> dict[int, list[int]]:
    """Per rank, the sorted times at which each of its tokens was first produced (by any of its processes):
    a token replayed after a rewind was already served once, so it is not served again."""
    first: dict[tuple[int, int, int], int] = {}
    for doc in stamps.values():
        for t, req, pos in doc["stamps"]:
            key = (int(doc["rank"]), int(req), int(pos))
            if key not in first or t < first[key]:
                first[key] = int(t)
    out: dict[int, list[int]] = {}
    for (rank, _, _), t in first.items():
        out.setdefault(rank, []).append(t)
    return {r: sorted(ts) for r, ts in out.items()}


def service_during_repairs(repairs: list[dict[str, Any]], events: list[dict[str, Any]],
                           stamps: dict[str, dict[str, Any]], before_ms: float = 1000.0) -> list[dict[str, Any]]:
    """Partial service per repair of a replicated job (DESIGN.md §5b). The repair window runs from the kill
    (or, for a death not sent by the coordinator, its detection) to the replacement's first token (``serve_again_ms``). Survivors' throughput counts new tokens (first
    productions) in that window, against the ``before_ms`` before the kill; the longest survivor stall is the
    longest time after the kill until a survivor's next new token, over the gaps that overlap the window (a
    survivor whose stream ended inside the window is not stalled after its last token)."""
    kills = sorted(e["t_kill_ns"] for e in events if e["event"] == "kill")
    new = _new_tokens(stamps)
    first_of = {w: min((int(s[0]) for s in d["stamps"]), default=None) for w, d in stamps.items()}
    rows, prev_plan = [], 0
    for rec in sorted(repairs, key=lambda x: x["t_plan_ns"]):
        since, prev_plan = prev_plan, rec["t_plan_ns"]
        if rec.get("mode") != "repair" or not rec.get("replacement"):
            continue
        starts = [first_of.get(w) for w in rec["replacement"].values()]
        if None in starts:
            continue  # the replacement died before it served (the next repair's window covers it)
        # the window opens at the kill we sent since the last repair; a death we did not send (a rank's own
        # fault) has no stamp of its own, so it opens at the detection (a stall across it still counts)
        sent = [k for k in kills if since < k <= rec["t_detect_ns"]]
        t_kill = sent[-1] if sent else rec["t_detect_ns"]
        t_back = max(s for s in starts if s is not None)
        survivors = [r for r in range(len(rec["members"])) if r not in rec["ranks"]]
        win_s = max(t_back - t_kill, 1) / 1e9
        during = sum(sum(1 for t in new.get(r, []) if t_kill <= t < t_back) for r in survivors)
        lo = t_kill - int(before_ms * 1e6)
        prior = sum(sum(1 for t in new.get(r, []) if lo <= t < t_kill) for r in survivors)
        stall = 0
        for r in survivors:
            ts = new.get(r, [])
            for a, b in zip(ts, ts[1:], strict=False):
                if b > t_kill and a < t_back:  # counted from the kill: a wait before it is not the repair's
                    stall = max(stall, b - max(a, t_kill))
        rows.append({"gen": int(rec["gen"]), "standby": ",".join(rec.get("standby", {}).values()),
                     "partial": bool(rec.get("partial")), "serve_again_ms": (t_back - t_kill) / 1e6,
                     "survivor_tokens_during": during, "survivor_tps_during": during / win_s,
                     "survivor_tps_before": prior / (before_ms / 1e3),
                     "longest_survivor_stall_ms": stall / 1e6})
    return rows
