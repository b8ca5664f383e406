"""The coordinator: a process outside the ranks that holds the store, the commit log and the standbys.

``python -m concordia_ft.distributed.coordinator --job-dir D`` (``launch.run_job`` starts it, and starts it
again on the same directory whenever it dies; any supervisor can do the same: exit 0 is done, 2 is a job
that failed, anything else (a signal, the OOM killer) means "start me again"). It owns (DESIGN.md §2):

- the ``TCPStore`` server every rank and standby connects to (never in a rank: the store survives any rank);
- the commit log (``epochs.CommitLog``): a cut is committed when every member's prepare is in the store;
- every process of the job, as its children: a pidfd per child makes a death an event (no polling latency),
  ``PR_SET_PDEATHSIG`` makes the children die with the coordinator (a restarted coordinator resumes the job
  from its commit log with fresh ranks);
- detection and classification (``health``), and the repair: a new generation whose members are the
  survivors plus a standby (hot, warm or cold), everyone resuming from the committed cut.

Events (kills, detections, plans, commits) go to ``events.jsonl``; ``result.json`` is written at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from . import protocol as P
from .epochs import CommitLog
from .health import (
    Beat,
    FailureKind,
    Timeouts,
    Verdict,
    classify_report,
    classify_silence,
    classify_stopped,
    classify_wedged,
    plan_timeouts,
)
from .options import DistOptions
from .workload import FINAL_UNKNOWN, job_final_cut, resolve

WORKER = "concordia_ft.distributed.worker"
ZYGOTE = "concordia_ft.distributed.zygote"


def _pdeathsig() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """A process of the job: one this coordinator started (``popen``), or a rank that outlived the previous
    coordinator and was adopted (``popen`` None: not our child, so its exit status is unknown; its pidfd
    still makes its death an event)."""

    wid: str
    role: str  # rank | hot | warm
    pid: int
    pidfd: int
    popen: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    ready: bool = False  # warm: printed "ready"; hot: wrote standby/<wid>
    spawned_ns: int = field(default_factory=time.monotonic_ns)
    gone: bool = False  # its exit was seen (pidfd)

    def alive(self) -> bool:
        if self.gone:
            return False
        if self.popen is not None:
            return self.popen.poll() is None
        return _proc_state(self.pid) not in ("", "Z")

    def reap(self) -> int | None:
        """Its exit status (None: adopted, not ours to reap) once it has exited."""
        self.gone = True
        return self.popen.wait() if self.popen is not None else None


class JobFailed(Exception):
    pass


class Coordinator:
    def __init__(self, job_dir: Path, opts: DistOptions) -> None:
        self.job_dir, self.opts = job_dir, opts
        self.store = dist.TCPStore("127.0.0.1", 0,  # type: ignore[attr-defined]  # re-exported without __all__
                                   is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.port = self.store.port
        (job_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.events = open(job_dir / "events.jsonl", "a", buffering=1)
        self.commits = CommitLog(job_dir / "coord", fsync=opts.fsync)
        self.final_cut = job_final_cut(opts)
        if self.commits.final:  # a replicated job's last cut is known once it is committed
            self.final_cut = self.commits.cut
        # survivors of a replicated job serve on through a repair (plan extra "partial", DESIGN.md §5b)
        self.partial = (bool(getattr(resolve(opts.workload), "replicated", False)) and opts.partial_service
                        and opts.on_failure == "repair")
        self.sel = selectors.DefaultSelector()
        self.children: dict[str, Child] = {}
        self.hot: list[str] = []
        self.warm: list[str] = []
        self.members: list[str] = []
        # generations are numbered across incarnations (a restarted coordinator's never repeats one: the
        # members' timings are keyed by generation)
        self.gen = max(self.commits.gen, _last_gen(job_dir / "events.jsonl")) + 1
        self.incarnation = sum(1 for _ in (job_dir / "coord").glob("incarnation.*"))
        (job_dir / "coord" / f"incarnation.{self.incarnation}").touch()
        (job_dir / "coord" / "pid").write_text(str(os.getpid()))
        self.resume = self.incarnation > 0  # a coordinator started again on the job's directory resumes it
        self.n_spawned = 0
        self.errors_seen = 0
        self.pending: list[tuple[dict[str, str], int]] = []
        self.beats: dict[str, tuple[bytes, int, Beat | None]] = {}
        self.slowest_ms: list[float] = []
        self.repairs: list[dict[str, Any]] = []
        self.repairs_since_commit = 0
        self.kills_done = 0
        self.dead_in_gen: list[int] = []
        self.gen_committed = False
        self.stopped: dict[str, int] = {}  # wid -> when the kernel first showed it stopped
        self.held_final = False  # every member prepared the final cut, its commit held for a kill still due
        self.expect_beat: dict[str, int] = {}  # kept ranks: when they were assigned (a first beat is due)
        self.spare: dict[str, Any] | None = None  # this generation's spare groups (offered, then ready)
        self.zygote: subprocess.Popen[bytes] | None = None
        self.zygote_ready = False
        self.zygote_fd = -1
        self.killed_in_gen = -1  # the generation in which this coordinator last sent a kill
        self.refills: list[str] = []  # standbys to start again once the current repair has committed
        rng_seed = int(opts.chaos.get("seed", 0)) + 7919 * self.incarnation
        self.rng = random.Random(rng_seed)
        self.next_chaos_ns = self._chaos_delay() if opts.chaos else None
        # kills an earlier incarnation already sent are not sent again (events.jsonl says which)
        sent = self._earlier_kills()
        self.kill_queue = list(opts.kills)[sent.count("scheduled"):]
        self.chaos_done = sent.count("chaos")

    # --------------------------------------------------------------------------------------- helpers
    def _earlier_kills(self) -> list[str]:
        """The ``why`` of every kill an earlier incarnation of this job's coordinator sent."""
        path = self.job_dir / "events.jsonl"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by the kill of the coordinator that wrote it
            if e.get("event") == "kill" and e.get("inc", 0) < self.incarnation:
                out.append(str(e.get("why")))
        return out

    def event(self, what: str, **kw: Any) -> None:
        self.events.write(json.dumps({"event": what, "t_ns": time.monotonic_ns(), "gen": self.gen,
                                      "inc": self.incarnation, **kw}) + "\n")

    def _new_wid(self) -> str:
        self.n_spawned += 1
        return f"i{self.incarnation}w{self.n_spawned}"

    def _base_env(self) -> dict[str, str]:
        return dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def _wid_env(self, wid: str) -> dict[str, str]:
        if self.opts.backend != "nccl":
            return {}
        # NCCL_RUNTIME_CONNECT=0: a communicator connects every channel at init (no lazy connect in a step)
        return {"NCCL_HOSTID": f"concordia-{wid}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0",
                "NCCL_RUNTIME_CONNECT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}

    def _start_zygote(self) -> None:
        """The job's fork server (zygote.py): later ranks and hot standbys are forked from it, torch imported."""
        log = open(self.job_dir / "logs" / "zygote.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=log, env=self._base_env(), preexec_fn=_pdeathsig)
        self.zygote, self.zygote_ready = p, False
        self.zygote_fd = os.pidfd_open(p.pid)
        assert p.stdout is not None
        self.sel.register(p.stdout, selectors.EVENT_READ, ("zygote", ""))
        self.sel.register(self.zygote_fd, selectors.EVENT_READ, ("zygote-exit", ""))

    def _on_zygote(self, what: str) -> None:
        assert self.zygote is not None and self.zygote.stdout is not None
        if what == "zygote":
            self.sel.unregister(self.zygote.stdout)
            self.zygote_ready = self.zygote.stdout.readline().strip() == b"ready"
            if self.zygote_ready:
                self.event("zygote-ready", pid=self.zygote.pid)
            return
        self.sel.unregister(self.zygote_fd)
        if not self.zygote_ready:
            self.sel.unregister(self.zygote.stdout)
        self.zygote_ready = False  # new processes are started from scratch again
        self.event("zygote-exit", rc=self.zygote.wait())

    def _fork(self, wid: str, role: str, argv: list[str]) -> int | None:
        """A worker forked by the zygote; its pid, or None (no zygote ready: start it from scratch)."""
        z = self.zygote
        if not self.zygote_ready or z is None or z.stdin is None or z.stdout is None:
            return None
        req = {"argv": argv, "role": role, "log": str(self.job_dir / "logs" / f"{wid}.log"),
               "env": self._wid_env(wid)}
        try:
            z.stdin.write(json.dumps(req).encode() + b"\n")
            z.stdin.flush()
            return int(z.stdout.readline())
        except (BrokenPipeError, ValueError):
            self.zygote_ready = False
            return None

    def spawn(self, role: str, wid: str | None = None, plan: P.Plan | None = None, *,
              from_scratch: bool = False) -> str:
        """Start a worker: forked from the zygote when it is ready (ranks and hot standbys), else (warm standbys,
        ``from_scratch``: the restart baseline, a new interpreter as a user's relaunch is) a new interpreter."""
        wid = wid or self._new_wid()
        argv = ["--job-dir", str(self.job_dir), "--port", str(self.port), "--wid", wid, "--role", role,
                "--coordinator-pid", str(os.getpid()), "--inc", str(self.incarnation)]
        if plan is not None:
            argv += ["--plan", plan.encode()]
        pid = self._fork(wid, role, argv) if role in ("rank", "hot") and not from_scratch else None
        if pid is not None:
            child = Child(wid, role, pid, os.pidfd_open(pid))
            self.children[wid] = child
            self.sel.register(child.pidfd, selectors.EVENT_READ, ("exit", wid))
            if role == "hot":
                self.hot.append(wid)
            self._write_pids()
            return wid
        env = {**self._base_env(), **self._wid_env(wid)}
        cmd = [sys.executable, "-m", WORKER, *argv]
        log = open(self.job_dir / "logs" / f"{wid}.log", "ab")
        # ranks outlive this coordinator (a new one adopts them, §2); standbys die with it, and so does every
        # process of the job when the launcher dies (CONCORDIA_DIST_LAUNCHER_PID, watched by each)
        popen = subprocess.Popen(cmd, stdin=subprocess.PIPE if role == "warm" else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE if role == "warm" else log, stderr=log, env=env,
                                 preexec_fn=None if role == "rank" else _pdeathsig)
        child = Child(wid, role, popen.pid, os.pidfd_open(popen.pid), popen, log)
        self.children[wid] = child
        self.sel.register(child.pidfd, selectors.EVENT_READ, ("exit", wid))
        if role == "warm":
            assert popen.stdout is not None
            self.sel.register(popen.stdout, selectors.EVENT_READ, ("warm", wid))
            self.warm.append(wid)
        elif role == "hot":
            self.hot.append(wid)
        self._write_pids()
        return wid

    def _write_pids(self) -> None:
        """Who is who (``coord/pids.json``): the members by rank, and every live process with its start time
        (a pid reused by another process is never mistaken for ours)."""
        procs = {c.wid: {"pid": c.pid, "role": c.role, "start": _start_time(c.pid), "up": c.wid in self.beats}
                 for c in self.children.values() if c.alive()}
        tmp = self.job_dir / "coord" / "pids.json.tmp"
        tmp.write_text(json.dumps({"members": self.members, "procs": procs}))
        os.replace(tmp, self.job_dir / "coord" / "pids.json")

    def _previous_members(self) -> dict[int, str]:
        """The ranks the previous coordinator's members still hold (rank -> wid): alive, the same processes, and
        up (they had beaten: one still starting never connected, and cannot reach this store's new address).
        Every other process it left (standbys, members still starting) is SIGKILLed: this one starts its own."""
        path = self.job_dir / "coord" / "pids.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        members, procs = doc.get("members", []), doc.get("procs", {})
        keep: dict[int, str] = {}
        for wid, info in procs.items():
            pid = int(info["pid"])
            # the same process: pid and start time (a forked worker's cmdline is its zygote's, so not that)
            if info.get("start") is None or _start_time(pid) != info.get("start") or _proc_state(pid) in ("", "Z"):
                continue
            if wid in members and len(members) == self.opts.world and info.get("up"):
                keep[members.index(wid)] = wid
                fd = os.pidfd_open(pid)
                self.children[wid] = Child(wid, "rank", pid, fd)
                self.sel.register(fd, selectors.EVENT_READ, ("exit", wid))
            else:
                os.kill(pid, signal.SIGKILL)
        return keep

    def _sigkill(self, wid: str) -> int:
        c = self.children.get(wid)
        t = time.monotonic_ns()
        if c is not None and c.alive():
            try:
                os.kill(c.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return t

    def publish(self, plan: P.Plan) -> None:
        self.store.set(P.plan_key(plan.gen), plan.encode())
        self.store.set(P.GEN, str(plan.gen))

    # ------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        kept = self._previous_members() if self.resume else {}
        self._start_zygote()  # beside the first ranks (they start from scratch; later processes fork from it)
        cut = self.commits.cut
        if cut >= 0:
            self.store.set(P.commit_key(cut), "1")
        self.event("start", cut=cut, resume=self.resume, final_cut=self.final_cut, port=self.port, pid=os.getpid(),
                   kept={str(r): w for r, w in kept.items()})
        if cut >= self.final_cut:
            self.event("already-done", cut=cut)
        self.members = [kept.get(r) or self._new_wid() for r in range(self.opts.world)]
        plan = P.Plan(self.gen, cut, tuple(self.members), "start" if not self.resume else "coordinator-restart",
                      {"kept": sorted(kept)} if kept else {})
        self.publish(plan)
        t_plan = time.monotonic_ns()
        for r, wid in enumerate(self.members):
            if r in kept:  # a live rank rejoins (it offers itself at adopt/<wid> once it sees this store)
                self.store.set(P.assign_key(wid), plan.encode())
                self.expect_beat[wid] = t_plan
            else:
                self.spawn("rank", wid, plan)
        self._write_endpoint()  # after the plan: a rank that sees this incarnation finds its assignment
        for _ in range(self.opts.standby.hot):
            self.spawn("hot")
        for _ in range(self.opts.standby.warm):
            self.spawn("warm")
        deadline = time.monotonic() + self.opts.job_timeout_s
        last_hb = 0
        try:
            while True:
                if time.monotonic() > deadline:
                    raise JobFailed(f"the job did not finish within job_timeout_s={self.opts.job_timeout_s}")
                for key, _ in self.sel.select(self.opts.poll_ms / 1e3):
                    what, wid = key.data
                    if what == "exit":
                        self._on_exit(wid)
                    elif what.startswith("zygote"):
                        self._on_zygote(what)
                    else:
                        self._on_warm_line(wid)
                self._check_commit()
                self._offer_spare()
                if self.commits.cut >= self.final_cut and self._members_exited():
                    break
                self._check_reports()
                now = time.monotonic_ns()
                if (now - last_hb) / 1e6 >= self.opts.heartbeat_ms:
                    last_hb = now
                    self._check_beats(now)
                self._scheduled_kills(now)
        except JobFailed as e:
            self.event("failed", reason=str(e))
            self._write_result("failed", str(e))
            return 2
        self.event("done", cut=self.commits.cut)
        self._write_result("done", "")
        return 0

    def shutdown(self) -> None:
        if self.zygote is not None and self.zygote.poll() is None:
            self.zygote.kill()
            self.zygote.wait()
        for c in self.children.values():
            if c.alive():
                try:
                    os.kill(c.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for c in self.children.values():
            if c.popen is not None:
                try:
                    c.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            else:
                while c.alive() and time.monotonic() < deadline:
                    time.sleep(0.002)
        self._write_pids()
        self.commits.close()

    def _write_endpoint(self) -> None:
        """``coord/endpoint.json``: where this incarnation's store is (ranks that outlived the previous one
        wait for a newer incarnation here, then rejoin)."""
        tmp = self.job_dir / "coord" / "endpoint.json.tmp"
        tmp.write_text(json.dumps({"inc": self.incarnation, "port": self.port, "pid": os.getpid()}))
        os.replace(tmp, self.job_dir / "coord" / "endpoint.json")

    # ------------------------------------------------------------------------------------- observing
    def _members_exited(self) -> bool:
        return all(not self.children[w].alive() for w in self.members)

    def _on_exit(self, wid: str) -> None:
        c = self.children[wid]
        self.sel.unregister(c.pidfd)
        os.close(c.pidfd)
        rc = c.reap()
        t = time.monotonic_ns()
        self._write_pids()
        if c.role == "warm" and c.popen is not None and c.popen.stdout is not None:
            try:
                self.sel.unregister(c.popen.stdout)
            except (KeyError, ValueError):
                pass
        pooled = wid in self.hot or wid in self.warm
        if wid in self.hot:
            self.hot.remove(wid)
        if wid in self.warm:
            self.warm.remove(wid)
        if wid not in self.members:
            self.event("exit", wid=wid, rc=rc, member=False, standby=pooled)
            if self.spare is not None and self.spare["standby"] == wid:
                self.spare = None  # the next ready standby is offered instead
            if pooled and self.opts.standby.refill and self.commits.cut < self.final_cut:
                self.spawn(c.role)
            return
        rank = self.members.index(wid)
        if self.commits.cut >= self.final_cut:  # the job's last cut is committed: nothing left to repair
            self.event("exit", wid=wid, rc=rc, rank=rank, member=True)
            return
        self.event("detect", wid=wid, rank=rank, rc=rc, kind=FailureKind.PROCESS_DEATH.value, t_detect_ns=t)
        self.dead_in_gen.append(rank)
        self._replace([rank], Verdict(FailureKind.PROCESS_DEATH, rank, ACTION_REPLACE,
                                      f"rank {rank} ({wid}) exited with {rc}"), t)

    def _on_warm_line(self, wid: str) -> None:
        c = self.children[wid]
        assert c.popen is not None and c.popen.stdout is not None
        line = c.popen.stdout.readline()
        self.sel.unregister(c.popen.stdout)
        if line.strip() == b"ready":
            c.ready = True

    def _prepared(self) -> bool:
        """Every member of this generation has prepared the next cut."""
        nxt = self.commits.cut + 1
        return nxt <= self.final_cut and self.store.check([P.prep_key(self.gen, nxt, r)
                                                          for r in range(self.opts.world)])

    def _check_commit(self) -> None:
        nxt = self.commits.cut + 1
        if not self._prepared() or self._hold_for_standby():
            return
        keys = [P.prep_key(self.gen, nxt, r) for r in range(self.opts.world)]
        final = nxt == self.final_cut
        if self.final_cut == FINAL_UNKNOWN:  # replicated: the first cut where no rank has work left is the last
            final = all(self.store.get(k).split(b",")[1] == b"0" for k in keys)
        if final and (self._kills_due() or self.killed_in_gen == self.gen):
            self.held_final = True  # the job does not end with a kill it was asked for unsent: sent first
            return
        ms = self.commits.commit(nxt, self.gen, final=final)
        if final:
            self.final_cut = nxt
        self.store.set(P.commit_key(nxt), "1")
        self.repairs_since_commit = 0
        if not self.gen_committed:
            self.gen_committed = True
            self.event("first-commit", cut=nxt, commit_ms=ms)
            # a new process's start (its CUDA context, its first kernels; on a small host its CPU) would
            # compete with the repair's first step: the refills start once the repair has committed
            self._start_refills()
        self.event("commit", cut=nxt, commit_ms=ms)

    def _check_reports(self) -> None:
        n = self.store.add(P.ERRORS, 0)
        while self.errors_seen < n and self.store.check([P.err_key(self.errors_seen + 1)]):
            self.errors_seen += 1
            rep = json.loads(self.store.get(P.err_key(self.errors_seen)))
            self.event("report", **rep)
            if int(rep.get("gen", -1)) == self.gen or rep.get("kind") == "cuda":
                self.pending.append((rep, time.monotonic_ns()))
        now = time.monotonic_ns()
        keep = []
        for rep, since in self.pending:
            if int(rep.get("gen", -1)) != self.gen and rep.get("kind") != "cuda":
                continue
            rank = int(rep.get("rank", -1))
            v = classify_report(rank, rep, since, now, self.opts, self.dead_in_gen)
            if v is None:
                if (now - since) / 1e6 < 10 * self.opts.collective_grace_ms and not self.dead_in_gen:
                    keep.append((rep, since))
                continue
            self.event("detect", rank=rank, kind=v.kind.value, detail=v.detail, t_detect_ns=now)
            if v.action is ACTION_REBUILD:
                self._rebuild(v, now)
            else:
                self._replace([rank], v, now, kill=True)
            keep = []
            break
        self.pending = keep

    def _timeouts(self) -> Timeouts:
        return plan_timeouts(self.slowest_ms[-64:], self.opts)

    def _check_beats(self, now: int) -> None:
        """Hangs, told from slow peers: a member the kernel shows stopped (certain, within ``stopped_ms``); a
        member whose heartbeat stopped; a member that computes (not waiting on its peers) for longer than the
        progress timeout; or every member waiting in a collective at once (the communicator: REBUILD)."""
        t = self._timeouts()
        for rank, wid in enumerate(self.members):
            c = self.children.get(wid)
            if c is not None and c.gone:
                continue  # its exit was seen (and acted on)
            v = self._stopped(rank, wid, now, t)
            if v is None:
                v = self._silent(rank, wid, now, t)
            if v is not None:
                self.event("detect", rank=rank, wid=wid, kind=v.kind.value, detail=v.detail, t_detect_ns=now)
                self._replace([rank], v, now, kill=True)
                return
        if self.beats and all(w in self.beats for w in self.members):
            v = classify_wedged([self.beats[w][2] for w in self.members], now, t)
            if v is not None:
                self.event("detect", rank=-1, kind=v.kind.value, detail=v.detail, t_detect_ns=now)
                self._rebuild(v, now)

    def _stopped(self, rank: int, wid: str, now: int, t: Timeouts) -> Verdict | None:
        c = self.children.get(wid)
        state = _proc_state(c.pid) if c is not None and not c.gone else ""
        if state != "T":
            self.stopped.pop(wid, None)
            return None
        since = self.stopped.setdefault(wid, now)
        return classify_stopped(rank, state, since, now, t)

    def _silent(self, rank: int, wid: str, now: int, t: Timeouts) -> Verdict | None:
        key = P.hb_key(wid)
        if not self.store.check([key]):
            since = self.expect_beat.get(wid)  # a kept rank is up: it must beat within the heartbeat timeout
            if since is not None and (now - since) / 1e6 > t.heartbeat_timeout_ms:
                return classify_silence(rank, None, since, now, t)
            return None  # not up yet (a cold standby imports torch): its pidfd reports a death meanwhile
        raw = self.store.get(key)
        old = self.beats.get(wid)
        if old is None or old[0] != raw:
            fresh = Beat.decode(raw)
            self.beats[wid] = (raw, now, fresh)
            if old is None:
                self._write_pids()  # it is up: a coordinator started after this one may keep it
            if fresh.slowest_step_ms > 0:
                self.slowest_ms.append(fresh.slowest_step_ms)
            return None
        _, seen, beat = old
        return classify_silence(rank, beat, seen, now, t)

    # ---------------------------------------------------------------------------------------- acting
    def _take_standby(self) -> tuple[str, str]:
        for kind in self.opts.standby.order:
            if kind == "hot":
                ready = self._spare_ready()
                if ready is not None and ready in self.hot:  # the one connected ahead goes first
                    self.hot.remove(ready)
                    return ready, "hot"
                for wid in list(self.hot):
                    if self.store.check([P.standby_key(wid)]):
                        self.hot.remove(wid)
                        return wid, "hot"
            elif kind == "warm":
                for wid in list(self.warm):
                    if self.children[wid].ready:
                        self.warm.remove(wid)
                        return wid, "warm"
            else:
                return self._new_wid(), "cold"
        return self._new_wid(), "cold"

    def _bump(self) -> None:
        self.repairs_since_commit += 1
        if self.repairs_since_commit > self.opts.max_rebuilds:
            raise JobFailed(f"{self.repairs_since_commit} repairs without a commit in between (max_rebuilds="
                            f"{self.opts.max_rebuilds}): the failure repeats; look at {self.job_dir}/logs")
        self.gen += 1
        self.dead_in_gen = []
        self.gen_committed = False
        self.held_final = False
        self.pending = []
        self.spare = None  # spare groups belong to the generation they were built in

    def _replace(self, ranks: list[int], v: Verdict, t_detect: int, *, kill: bool = False,
                 t_kill: int | None = None) -> None:
        if kill:
            for r in ranks:
                self._sigkill(self.members[r])
        if self.opts.on_failure == "restart":
            self._restart_all(v, t_detect)
            return
        spare = self._spare_ready() if len(ranks) == 1 else None
        spare_gen = self.gen
        self._bump()
        failed_wids = [self.members[r] for r in ranks]
        kinds = {}
        for r in ranks:
            wid, kind = self._take_standby()
            self.members[r] = wid
            kinds[r] = (wid, kind)
        extra: dict[str, Any] = {"failed": ranks, "detail": v.detail}
        if spare is not None and kinds[ranks[0]][0] == spare:
            # every member holds the group of (survivors + this standby) since the spare's boundary: use it
            extra["spare"] = {"gen": spare_gen, "standby": spare, "failed": ranks[0]}
        if self.partial:
            extra["partial"] = True  # survivors keep their state and serve on; the group reforms at cut + 1
        plan = P.Plan(self.gen, self.commits.cut, tuple(self.members), v.kind.value, extra)
        self.publish(plan)
        t_plan = time.monotonic_ns()
        for wid, kind in kinds.values():
            if kind == "hot":
                self.store.set(P.assign_key(wid), plan.encode())
            elif kind == "warm":
                c = self.children[wid]
                assert c.popen is not None and c.popen.stdin is not None
                try:
                    c.popen.stdin.write(plan.encode().encode() + b"\n")
                    c.popen.stdin.flush()
                except BrokenPipeError:
                    pass  # it died since it said ready: its pidfd reports a member's death, replaced again
            else:
                self.spawn("rank", wid, plan)
            if kind in ("hot", "warm") and self.opts.standby.refill:
                self.refills.append(kind)  # started once this generation commits: not on the repair's path
        rec = {"gen": self.gen, "cut": plan.cut, "kind": v.kind.value, "action": v.action.value,
               "ranks": ranks, "standby": {str(r): k for r, (_, k) in kinds.items()},
               "replacement": {str(r): w for r, (w, _) in kinds.items()}, "failed_wids": failed_wids,
               "t_detect_ns": t_detect,
               "t_plan_ns": t_plan, "members": list(self.members), "mode": "repair",
               "partial": self.partial, "spare": "spare" in extra, "detail": v.detail}
        self.repairs.append(rec)
        self.event("plan", **rec)

    def _rebuild(self, v: Verdict, t_detect: int) -> None:
        failed_wids = [self.members[v.rank]] if 0 <= v.rank < len(self.members) else []
        self._bump()
        plan = P.Plan(self.gen, self.commits.cut, tuple(self.members), v.kind.value, {"detail": v.detail})
        self.publish(plan)
        rec = {"gen": self.gen, "cut": plan.cut, "kind": v.kind.value, "action": v.action.value, "ranks": [],
               "t_detect_ns": t_detect, "t_plan_ns": time.monotonic_ns(), "members": list(self.members),
               "failed_wids": failed_wids, "mode": "rebuild"}
        self.repairs.append(rec)
        self.event("plan", **rec)

    def _restart_all(self, v: Verdict, t_detect: int) -> None:
        """The baseline a user runs today: kill every rank, start new processes, restore, init the group."""
        failed_wids = [self.members[v.rank]] if 0 <= v.rank < len(self.members) else []
        for wid in self.members:
            self._sigkill(wid)
        for wid in self.members:
            c = self.children[wid]
            deadline = time.monotonic() + 10
            while c.alive() and time.monotonic() < deadline:
                time.sleep(0.001)
        t_killed = time.monotonic_ns()
        self._bump()
        self.members = [self._new_wid() for _ in range(self.opts.world)]
        plan = P.Plan(self.gen, self.commits.cut, tuple(self.members), v.kind.value, {"restart": True})
        self.publish(plan)
        t_plan = time.monotonic_ns()
        for wid in self.members:
            self.spawn("rank", wid, plan, from_scratch=True)
        rec: dict[str, Any] = {"gen": self.gen, "cut": plan.cut, "kind": v.kind.value, "action": "restart-all",
               "ranks": [v.rank], "standby": {}, "failed_wids": failed_wids, "t_detect_ns": t_detect,
               "t_abort_end_ns": t_killed,
               "t_plan_ns": t_plan, "members": list(self.members), "mode": "restart"}
        self.repairs.append(rec)
        self.event("plan", **rec)

    def _chaos_delay(self) -> int:
        lo = float(self.opts.chaos.get("min_delay_ms", 20))
        hi = float(self.opts.chaos.get("max_delay_ms", 400))
        return time.monotonic_ns() + int(self.rng.uniform(lo, hi) * 1e6)

    def _scheduled_kills(self, now: int) -> None:
        if self.next_chaos_ns is not None and now >= self.next_chaos_ns:
            if self.chaos_done < int(self.opts.chaos.get("kills", 0)) and self.commits.cut < self.final_cut:
                rank = self.rng.randrange(self.opts.world)
                self.chaos_done += 1
                self._kill_member(rank, "chaos")
                self.next_chaos_ns = self._chaos_delay()
            else:
                self.next_chaos_ns = None
        # a replicated job's end is not known up front: a kill after a cut it ends before is sent at its end
        due = self.kill_queue and (self.commits.cut >= int(self.kill_queue[0]["after_cut"]) or self.held_final)
        if due and self._settled():
            k = self.kill_queue.pop(0)
            self._kill_member(int(k["rank"]), "scheduled")

    def _hold_for_standby(self) -> bool:
        """A scheduled kill is due but the standby it is meant to be repaired from is not up yet (a process
        starting takes seconds; a small job's steps take milliseconds): the next commit waits for it, so the
        kill tests the standby it names instead of the job outrunning it."""
        if not self.kill_queue or self.commits.cut < int(self.kill_queue[0]["after_cut"]):
            return False
        first = self._preferred()
        if first in self.refills:
            self._start_refills()  # a kill waits for this standby: start it now
        if first == "hot" and self.opts.standby.hot:
            return bool(self.hot) and not any(self.store.check([P.standby_key(w)]) for w in self.hot)
        if first == "warm" and self.opts.standby.warm:
            return bool(self.warm) and not any(self.children[w].ready for w in self.warm)
        return False

    def _start_refills(self) -> None:
        for kind in self.refills:
            self.spawn(kind)
        self.refills = []

    def _preferred(self) -> str:
        """The kind of standby a repair takes first: the first in ``order`` whose pool is not empty."""
        sb = self.opts.standby
        return next((k for k in sb.order if k == "cold" or (sb.hot if k == "hot" else sb.warm) > 0), "cold")

    def _kills_due(self) -> bool:
        """A scheduled kill, or a chaos kill, that has not been sent yet."""
        return bool(self.kill_queue) or (bool(self.opts.chaos)
                                         and self.chaos_done < int(self.opts.chaos.get("kills", 0)))

    def _spares_apply(self) -> bool:
        return (self.opts.standby.preconnect and self.opts.on_failure == "repair" and not self.partial
                and self.opts.standby.hot > 0)

    def _offer_spare(self) -> None:
        """A hot standby is ready and this generation has no spare groups: have every member and the standby
        build them at the boundary of cut C + 2 (C committed): no member has prepared that cut yet (a member
        prepares a cut only once the one before is committed, and this is written before the next commit),
        so every member builds at the same boundary, and in the same order (DESIGN.md §5c)."""
        if self.spare is not None or not self._spares_apply() or not self.gen_committed:
            return
        at = self.commits.cut + 2
        if at >= self.final_cut:
            return
        sid = next((w for w in self.hot if self.store.check([P.standby_key(w)])), None)
        if sid is None:
            return
        doc = json.dumps({"gen": self.gen, "standby": sid, "at_cut": at, "members": list(self.members)})
        self.store.set(P.spare_key(self.gen), doc)
        self.store.set(P.spare_for_key(sid), doc)
        self.spare = {"gen": self.gen, "standby": sid, "at_cut": at}
        self.event("spare-offer", standby=sid, at_cut=at)

    def _spare_ready(self) -> str | None:
        """The standby every member holds spare groups with (in this generation), or None."""
        sp = self.spare
        if sp is None or sp["gen"] != self.gen or sp["standby"] not in self.hot:
            return None
        if sp.get("failed"):
            return None
        if not sp.get("ready"):
            keys = [P.spare_ok_key(self.gen, w) for w in [*self.members, sp["standby"]]]
            if not self.store.check(keys):
                return None
            bad = [v for v in (self.store.get(k) for k in keys) if v != b"ok"]
            if bad:  # a build failed: repairs build their group as without spares
                sp["failed"] = True
                self.event("spare-failed", standby=sp["standby"], detail=bad[0].decode()[:300])
                return None
            sp["ready"] = True
            self.event("spare-ready", standby=sp["standby"])
        return str(sp["standby"])

    def _settled(self) -> bool:
        """The last repair is over (a commit in this generation, or every member prepared the next cut) and
        the preferred standby is ready (connected ahead, where spare groups apply)."""
        if self.killed_in_gen == self.gen or (not self.gen_committed and not self._prepared()):
            return False  # the last kill's repair has not even started
        first = self._preferred()
        if first == "hot" and self.opts.standby.hot:
            if self._spares_apply() and self.commits.cut + 2 < self.final_cut and not (
                    self.spare is not None and self.spare.get("failed")):
                return self._spare_ready() is not None
            return any(self.store.check([P.standby_key(w)]) for w in self.hot)
        if first == "warm" and self.opts.standby.warm:
            return any(self.children[w].ready for w in self.warm)
        return True

    def _kill_member(self, rank: int, why: str) -> None:
        wid = self.members[rank]
        t = self._sigkill(wid)
        self.kills_done += 1
        self.gen_committed = False  # not settled until the repair this kill causes has committed a cut
        self.killed_in_gen = self.gen
        self.event("kill", rank=rank, wid=wid, why=why, t_kill_ns=t, cut=self.commits.cut)

    # ---------------------------------------------------------------------------------------- result
    def _write_result(self, status: str, reason: str) -> None:
        results = {}
        for r in range(self.opts.world):
            if self.store.check([P.done_key(r)]):
                results[str(r)] = json.loads(self.store.get(P.done_key(r)))
        timings: dict[str, list[dict[str, Any]]] = {}
        for rec in self.repairs + [{"gen": self.repairs[0]["gen"] - 1 if self.repairs else self.gen,
                                    "members": self.members}]:
            g = int(rec["gen"])
            for wid in set(rec["members"]) | set(self.children):
                key = P.timing_key(g, wid)
                if self.store.check([key]):
                    timings.setdefault(str(g), []).append(json.loads(self.store.get(key)))
        doc = {"status": status, "reason": reason, "final_cut": self.final_cut, "committed": self.commits.cut,
               "incarnation": self.incarnation, "results": results, "repairs": self.repairs, "timings": timings,
               "kills": self.kills_done, "commit_history": self.commits.history}
        tmp = self.job_dir / f"result.{self.incarnation}.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.job_dir / f"result.{self.incarnation}.json")


from .health import Action  # noqa: E402

ACTION_REPLACE = Action.REPLACE


def _last_gen(events: Path) -> int:
    """The newest generation any earlier incarnation of the job's coordinator published (-1: none)."""
    best = -1
    for line in events.read_text().splitlines() if events.exists() else []:
        try:
            best = max(best, int(json.loads(line).get("gen", -1)))
        except (json.JSONDecodeError, ValueError, TypeError):
            continue
    return best


def _start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot, /proc/<pid>/stat field 22): with the pid, its identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _proc_state(pid: int) -> str:
    """The kernel's one-letter state of a process (R, S, D, T stopped, t traced, Z zombie; "" gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3].decode()
ACTION_REBUILD = Action.REBUILD


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="concordia_ft.distributed.coordinator")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--standby", action="store_true",
                    help="import everything, then wait for a line 'go' on stdin (launch.run_job's next coordinator)")
    a = ap.parse_args(argv)
    if a.standby and sys.stdin.readline().strip() != "go":
        return 0  # not needed: the job ended
    job_dir = Path(a.job_dir)
    opts = DistOptions.from_json((job_dir / "options.json").read_text())
    coord = Coordinator(job_dir, opts)
    def on_sigterm(*_: object) -> None:
        coord.shutdown()
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return coord.run()
    finally:
        coord.shutdown()


if __name__ == "__main__":
    sys.exit(main())
