"""Start a distributed job and wait for it: the coordinator as a child process, started again whenever it dies.

``run_job(job_dir, options)`` writes ``options.json``, starts the coordinator, and returns its
``result.<incarnation>.json`` documents as a ``JobResult``. A coordinator that dies of anything but its own
verdict (exit 0: done, 2: failed) is started again on the same directory: it reads its commit log and the job
resumes from the committed cut (DESIGN.md §2). A supervisor of the user's (systemd, Kubernetes) can run
``python -m concordia_ft.distributed.coordinator --job-dir D`` the same way: restart it unless it exited 0 or 2.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
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
    coordinator_restarts: int  # coordinators started again after they died (SIGKILL, OOM, a crash)
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
    env["CONCORDIA_DIST_LAUNCHER_PID"] = str(os.getpid())  # every process of the job dies when this one does
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _committed(events: Path) -> int:
    """The newest cut the job's coordinators have committed, from events.jsonl (-1: none)."""
    best = -1
    try:
        data = events.read_bytes()
    except OSError:
        return best
    for line in data.splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn by a coordinator killed while writing it
        if e.get("event") == "commit":
            best = max(best, int(e["cut"]))
    return best


EXIT_DONE, EXIT_FAILED = 0, 2  # the coordinator's verdicts; any other exit (a signal, a crash) restarts it
MAX_FRUITLESS_RESTARTS = 3  # coordinator deaths in a row with no cut committed in between: a crash loop


def run_job(job_dir: str | Path, options: DistOptions | Mapping[str, Any], *,
            timeout_s: float | None = None) -> JobResult:
    """Run the job in ``job_dir`` to its end and return its result. The coordinator is restarted on the same
    directory whenever it dies of anything but its own verdict (SIGKILL from outside, the OOM killer, a
    crash): the new one resumes the job from its commit log. An existing ``job_dir`` of the same job is
    resumed the same way (calling ``run_job`` again after the launcher itself was killed). Bad input (an
    unknown workload, a shape that does not fit the world, a kill that could never fire) raises
    ``ConfigError`` before anything starts."""
    from .workload import validate

    opts = DistOptions.coerce(options)
    validate(opts)  # a job that cannot run is refused here, with the cause, before any process starts
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "options.json").write_text(opts.to_json())
    t0 = time.monotonic()
    limit = timeout_s if timeout_s is not None else opts.job_timeout_s + 30
    events = job_dir / "events.jsonl"
    restarts, fruitless = 0, 0
    reaper = _Reaper(job_dir)
    nxt = _start_coordinator(job_dir, standby=True)
    p = _start_coordinator(job_dir, standby=False)
    while True:
        before = _committed(events)
        while p.poll() is None:
            reaper.reap()
            if time.monotonic() - t0 > limit:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
                nxt.kill()
                reaper.finish()
                raise JobError(f"the job in {job_dir} did not finish in {limit:.0f} s; see coordinator.log, "
                               "events.jsonl and logs/")
            time.sleep(0.02)
        rc = p.returncode
        if rc in (EXIT_DONE, EXIT_FAILED):
            nxt.kill()
            nxt.wait()
            reaper.finish()
            break
        fruitless = fruitless + 1 if _committed(events) <= before else 0
        if fruitless > MAX_FRUITLESS_RESTARTS:
            nxt.kill()
            reaper.finish()
            raise JobError(f"the coordinator of {job_dir} died {fruitless} times in a row without committing a "
                           f"cut (last exit {_exit_text(rc)}); see coordinator.log")
        restarts += 1
        p, nxt = _take_over(nxt, job_dir), _start_coordinator(job_dir, standby=True)
    docs = [json.loads(f.read_text()) for f in sorted(job_dir.glob("result.*.json"))]
    all_events = []
    for line in events.read_text().splitlines():
        try:
            all_events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    mine = [d for d in docs if d.get("incarnation") is not None]
    last = max(mine, key=lambda d: d["incarnation"]) if mine else None
    if last is None or rc != EXIT_DONE:
        reason = last["reason"] if last is not None and last.get("reason") else f"the coordinator exited with {rc}"
        raise JobError(f"the job in {job_dir} failed: {reason}; see coordinator.log, events.jsonl and logs/")
    # every repair from the events (a coordinator killed mid-job wrote no result document, but its plans are
    # in events.jsonl); the event's own keys dropped
    repairs = [{k: v for k, v in e.items() if k not in ("event", "t_ns", "inc")} for e in all_events
               if e["event"] == "plan"]
    return JobResult(last["status"], {int(k): v for k, v in last["results"].items()}, repairs,
                     {int(k): v for d in docs for k, v in d["timings"].items()}, all_events,
                     sum(d["kills"] for d in docs), restarts, job_dir, time.monotonic() - t0, docs)


def _start_coordinator(job_dir: Path, *, standby: bool) -> subprocess.Popen[bytes]:
    """A coordinator for ``job_dir``. ``standby``: it imports everything (torch: seconds on a loaded host) and
    waits for "go" on stdin, so the one that takes over from a dead coordinator starts in milliseconds."""
    cmd = [sys.executable, "-m", "concordia_ft.distributed.coordinator", "--job-dir", str(job_dir)]
    with open(job_dir / "coordinator.log", "ab") as log:
        return subprocess.Popen([*cmd, "--standby"] if standby else cmd, stdin=subprocess.PIPE if standby else None,
                                stdout=log, stderr=log, env=_env(), preexec_fn=_pdeathsig)


def _take_over(nxt: subprocess.Popen[bytes], job_dir: Path) -> subprocess.Popen[bytes]:
    """The standby coordinator, told to go (or a new one, if the standby died)."""
    try:
        assert nxt.stdin is not None
        nxt.stdin.write(b"go\n")
        nxt.stdin.close()
        return nxt
    except (BrokenPipeError, OSError):
        nxt.wait()
        return _start_coordinator(job_dir, standby=False)


class _Reaper:
    """Ranks outlive a killed coordinator (the next one keeps them), so they are reparented: to this process,
    which makes itself their subreaper (PR_SET_CHILD_SUBREAPER) and reaps them when they exit. Only the job's
    own processes (named in ``coord/pids.json``) are reaped here; ``finish`` SIGKILLs any still alive after
    the job ended (none, unless a coordinator died with the job unfinished), reaps them, and stops being a
    subreaper."""

    def __init__(self, job_dir: Path) -> None:
        self.path = job_dir / "coord" / "pids.json"
        self.job = str(job_dir).encode()
        self.pids: set[int] = set()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER

    def _learn(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
            self.pids |= {int(v["pid"]) for v in doc.get("procs", {}).values()}
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def reap(self) -> None:
        self._learn()
        for pid in list(self.pids):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    self.pids.discard(pid)
            except ChildProcessError:  # not (yet) ours: still the coordinator's child, or reaped already
                if not os.path.exists(f"/proc/{pid}"):
                    self.pids.discard(pid)

    def finish(self) -> None:
        self._learn()
        for pid in list(self.pids):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"concordia_ft.distributed.worker" in cmd and self.job in cmd:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while self.pids and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.005)
        # this process stops adopting orphans: other processes it runs (a server's keeper, say) keep the
        # ordinary reparenting to init
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 0)


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"
