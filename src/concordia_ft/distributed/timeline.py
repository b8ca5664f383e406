"""Per-phase recovery times of a finished job, from its events and its members' timings (all monotonic ns
of one host, so the coordinator's and the ranks' stamps compare directly).

For each repair: ``detection`` (kill -> the coordinator knows), ``decide`` (-> plan published), ``abort``
(the longest time a survivor spent leaving the broken communicator), ``start`` (a cold standby or a
restart: plan -> the new process has the model), ``restore`` (the replacement's replay of the dead rank's log
into its state), ``rebuild`` (the last member ready -> every member holds the new group), ``first_step``
(-> every member finished the replayed step), ``total`` (kill -> every member finished that step).
"""

from __future__ import annotations

from typing import Any


def recovery_phases(repairs: list[dict[str, Any]], timings: dict[int, list[dict[str, Any]]],
                    events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kills = sorted(e["t_kill_ns"] for e in events if e["event"] == "kill")
    rows = []
    for rec in repairs:
        g = int(rec["gen"])
        members = timings.get(g, [])
        if len(members) < len(rec["members"]):
            continue  # a later failure interrupted this repair before every member's first step
        t_det, t_plan = rec["t_detect_ns"], rec["t_plan_ns"]
        before = [k for k in kills if k <= t_det]
        t_kill = before[-1] if before else None
        new = [m for m in members if m["role"] != "survivor"]
        old = [m for m in members if m["role"] == "survivor"]
        ready = max(m["group_ready_ns"] for m in members)
        joined = max([m["restore_end_ns"] for m in new] + [m["plan_seen_ns"] for m in old])
        first = max(m["first_step_end_ns"] for m in members)
        row: dict[str, Any] = {
            "gen": g, "recovery": rec["mode"], "failure": rec["kind"], "standby": ",".join(rec.get("standby", {}).values()) or rec["mode"],
            "cut": rec["cut"], "detection_ms": (t_det - t_kill) / 1e6 if t_kill is not None else None,
            "decide_ms": (t_plan - t_det) / 1e6,
            "abort_ms": max((m["abort_ms"] for m in old), default=0.0),
            "start_ms": max(((m["assigned_ns"] - t_plan) / 1e6 for m in new), default=0.0),
            "restore_ms": max((m["restore_ms"] for m in new), default=0.0),
            "rebuild_ms": (ready - joined) / 1e6, "first_step_ms": (first - ready) / 1e6,
            "total_ms": (first - t_kill) / 1e6 if t_kill is not None else None,
        }
        if rec["mode"] == "restart":
            row["abort_ms"] = (rec["t_abort_end_ns"] - t_det) / 1e6
        rows.append(row)
    return rows


def load_stamps(job_dir: Any) -> dict[str, dict[str, Any]]:
    """Every process's token stamps (``stamps/<wid>.jsonl``: a header line, then one list of [t_ns, request,
    position] per round served), as {wid: {"wid", "rank", "role", "stamps"}}; a torn last line (a process
    killed while writing it) is dropped."""
    import json
    from pathlib import Path

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
    longest gap between a survivor's consecutive new tokens that overlaps the window (a survivor whose stream
    ended inside the window is not stalled after its last token)."""
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
                if b > t_kill and a < t_back:
                    stall = max(stall, b - a)
        rows.append({"gen": int(rec["gen"]), "standby": ",".join(rec.get("standby", {}).values()),
                     "partial": bool(rec.get("partial")), "serve_again_ms": (t_back - t_kill) / 1e6,
                     "survivor_tokens_during": during, "survivor_tps_during": during / win_s,
                     "survivor_tps_before": prior / (before_ms / 1e3),
                     "longest_survivor_stall_ms": stall / 1e6})
    return rows
