"""Start a distributed job and wait for it: the coordinator as a child process (restarted if it dies).

``run_job(job_dir, options)`` writes ``options.json``, starts the coordinator, and returns its
``result.<incarnation>.json`` as a ``JobResult``. ``kill_coordinator_at_s`` (tests) SIGKILLs the
coordinator that long after each start and starts it again with ``--resume``: its ranks die with it, the new
one reads its commit log and starts fresh ranks from the committed cut.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConcordiaError
from .options import DistOptions


class JobError(ConcordiaError):
    """A distributed job did not finish; the message says where its logs are."""


@dataclass
class JobResult:
    status: str
    results: dict[int, dict[str, Any]]
    repairs: list[dict[str, Any]]
    timings: dict[int, list[dict[str, Any]]]
    events: list[dict[str, Any]]
    kills: int
    coordinator_kills: int
    job_dir: Path
    wall_s: float
    raw: list[dict[str, Any]] = field(default_factory=list)  # every incarnation's result document

    def same_on_every_rank(self) -> dict[str, Any]:
        """The result all ranks agree on (replicated state): raises if they differ."""
        vals = list(self.results.values())
        if not vals or any(v != vals[0] for v in vals[1:]):
            raise JobError(f"ranks disagree on the result: {self.results}")
        return vals[0]


def _pdeathsig() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # the job dies with its launcher


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _committed_in(events: Path, pos: int) -> tuple[int, int]:
    """The newest cut committed in the events appended since ``pos``; and the new position."""
    best = -1
    try:
        with open(events, "rb") as f:
            f.seek(pos)
            data = f.read()
    except OSError:
        return best, pos
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        e = json.loads(line)
        if e["event"] == "commit":
            best = max(best, int(e["cut"]))
    return best, pos + end


def run_job(job_dir: str | Path, options: DistOptions | Mapping[str, Any], *,
            kill_coordinator_at_s: Sequence[float] = (), kill_coordinator_after_cut: Sequence[int] = (),
            timeout_s: float | None = None) -> JobResult:
    opts = DistOptions.coerce(options)
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "options.json").write_text(opts.to_json())
    t0 = time.monotonic()
    limit = timeout_s if timeout_s is not None else opts.job_timeout_s + 30
    kills = list(kill_coordinator_at_s)
    cut_kills = list(kill_coordinator_after_cut)
    events = job_dir / "events.jsonl"
    pos = events.stat().st_size if events.exists() else 0
    ck = 0
    resume = False
    while True:
        cmd = [sys.executable, "-m", "concordia_ft.distributed.coordinator", "--job-dir", str(job_dir)]
        if resume:
            cmd.append("--resume")
        with open(job_dir / "coordinator.log", "ab") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=log, env=_env(), preexec_fn=_pdeathsig)
        kill_at = time.monotonic() + kills.pop(0) if kills else None
        kill_cut = cut_kills.pop(0) if cut_kills else None
        while p.poll() is None:
            if kill_cut is not None:
                newest, pos = _committed_in(events, pos)
                if newest >= kill_cut:
                    kill_at = time.monotonic()
            if kill_at is not None and time.monotonic() >= kill_at:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
                ck += 1
                break
            if time.monotonic() - t0 > limit:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
                raise JobError(f"the job in {job_dir} did not finish in {limit:.0f} s; see coordinator.log, "
                               "events.jsonl and logs/")
            time.sleep(0.005)
        if p.returncode == -signal.SIGKILL and kill_at is not None:
            resume = True
            continue
        break
    docs = [json.loads(f.read_text()) for f in sorted(job_dir.glob("result.*.json"))]
    events = [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    if not docs or p.returncode != 0:
        reason = docs[-1]["reason"] if docs else f"the coordinator exited with {p.returncode}"
        raise JobError(f"the job in {job_dir} failed: {reason}; see coordinator.log, events.jsonl and logs/")
    last = max(docs, key=lambda d: d["incarnation"])
    return JobResult(last["status"], {int(k): v for k, v in last["results"].items()},
                     [r for d in docs for r in d["repairs"]],
                     {int(k): v for d in docs for k, v in d["timings"].items()}, events,
                     sum(d["kills"] for d in docs), ck, job_dir, time.monotonic() - t0, docs)
