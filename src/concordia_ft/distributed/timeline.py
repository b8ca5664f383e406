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
