"""A rank or a standby of a distributed job (started by the coordinator; not a user command).

``python -m concordia_ft.distributed.worker --job-dir D --port P --wid W --role rank|hot|warm [--plan JSON]``

- ``rank`` (and a cold standby): connect to the store, join the plan given on the command line.
- ``hot``: build the model, connect, say ``standby/<wid>`` and wait for ``assign/<wid>`` (a store wait: it
  wakes the moment the key is written).
- ``warm``: build the model, print ``ready``, read the plan from stdin, then connect.

A member restores the rank's state at the plan's cut from the rank's own log (``ranks/<rank>``), builds the
generation's group, replays from the cut, and on ``Interrupted`` aborts the group, waits for the next plan,
rewinds to its cut and goes again: in the same process, the model kept (DESIGN.md §5). A member of a
replicated workload (``replica_serve``) under a ``partial`` plan does not rewind: it serves its own requests
while it waits for the plan and while the new group forms, and joins it at the next cut (DESIGN.md §5b).
Exit codes: 0 done, 3 the coordinator is gone, 4 no longer a member (replaced), 1 an error (reported).
"""

from __future__ import annotations

import time

STARTED_NS = time.monotonic_ns()  # before the heavy imports: a cold standby's start is measured from here

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from . import protocol as P  # noqa: E402
from .epochs import RankEpochs  # noqa: E402
from .group import FaultInjector, FaultTolerantGroup, Interrupted, Watch, build_group, connect_store  # noqa: E402
from .health import classify_exception  # noqa: E402
from .options import DistOptions  # noqa: E402
from .workload import Workload, build, job_final_cut  # noqa: E402
from .workloads import state_digest  # noqa: E402

EXIT_DONE, EXIT_ERROR, EXIT_COORDINATOR, EXIT_REPLACED = 0, 1, 3, 4


class Member:
    """One process's life as a member of the job: restore, build, run, repair, repeat."""

    def __init__(self, opts: DistOptions, job_dir: Path, port: int, wid: str, wl: Workload, model_ms: float,
                 role: str) -> None:
        self.opts, self.job_dir, self.wid, self.wl, self.role = opts, job_dir, wid, wl, role
        self.port = port
        self.model_ms = model_ms
        self.store = connect_store(port)
        self.watch = Watch(port, wid, opts.heartbeat_ms)
        self.faults = FaultInjector(list(opts.faults), job_dir, wid)
        self.steps = job_final_cut(opts)  # the job's last cut
        self.epochs: RankEpochs | None = None
        self.rank = -1
        self.group: FaultTolerantGroup | None = None
        self.resumed_cut = -1
        self.timing: dict[str, Any] = {}
        self._stamps_out: Any = None  # replicated workloads: the token stamps file
        self._stamps_sent = 0

    # ----------------------------------------------------------------------------------------- life
    def run(self, plan: P.Plan) -> int:
        t0 = time.monotonic_ns()
        self.rank = plan.rank_of(self.wid)  # type: ignore[assignment]
        self.wl.bind(self.rank)
        self.faults.rank, self.faults.gen = self.rank, plan.gen
        self.faults.hit("restore", plan.cut)
        self.epochs = RankEpochs(self.job_dir / "ranks" / str(self.rank), self.wl.state(), fsync=self.opts.fsync)
        slots = self.epochs.restore()
        self.epochs.rewind(plan.cut, self.wl.initial_state())
        t1 = time.monotonic_ns()
        self.timing = {"wid": self.wid, "rank": self.rank, "role": self.role, "started_ns": STARTED_NS,
                       "model_ms": self.model_ms, "assigned_ns": t0, "restore_start_ns": t0, "restore_end_ns": t1,
                       "restore_ms": (t1 - t0) / 1e6, "log_slots": slots, "resumed_cut": plan.cut,
                       "resume_digest": state_digest(self.wl.state())}
        while True:
            try:
                return self._generation(plan)
            except Interrupted as e:
                t_int = time.monotonic_ns()
                self.watch.in_step = False  # waiting for a plan is not a step: no progress timeout applies
                abort_ms = self.group.abort() if self.group is not None else 0.0
                t_ab = time.monotonic_ns()
                if e.reason == "coordinator":
                    return EXIT_COORDINATOR
                if e.reason == "collective":
                    self._report("collective", e.message, plan.gen)
                nxt = self._next_plan(plan.gen, serve=self._replicated and self.opts.partial_service)
                if nxt is None:
                    return EXIT_COORDINATOR
                if nxt.rank_of(self.wid) != self.rank:
                    return EXIT_REPLACED
                assert self.epochs is not None
                if not self._partial(nxt):  # a partial plan keeps a survivor's state: nothing it did is undone
                    self.epochs.rewind(nxt.cut, self.wl.initial_state())
                self.timing = {"wid": self.wid, "rank": self.rank, "role": "survivor", "interrupted_ns": t_int,
                               "interrupt": e.reason, "abort_start_ns": t_int, "abort_end_ns": t_ab,
                               "abort_ms": abort_ms, "plan_seen_ns": time.monotonic_ns(), "resumed_cut": nxt.cut,
                               "failed_gen": plan.gen, "resume_digest": state_digest(self.wl.state())}
                plan = nxt
                self.faults.gen = plan.gen

    @property
    def _replicated(self) -> bool:
        return bool(getattr(self.wl, "replicated", False))

    def _partial(self, plan: P.Plan) -> bool:
        return self._replicated and bool(plan.extra.get("partial"))

    def _generation(self, plan: P.Plan) -> int:
        self.group = None
        self.resumed_cut = plan.cut
        self.timing["rebuild_start_ns"] = time.monotonic_ns()
        partial = self._partial(plan)
        pg = self._build(plan, serve=partial)
        # a partial generation reforms at cut + 1: the committed cut's state is not every member's any more
        self.group = FaultTolerantGroup(pg, store=self.store, backend=self.opts.backend, gen=plan.gen,
                                        rank=self.rank, world=plan.world, watch=self.watch, on_cut=self._cut,
                                        every=self.wl.collectives_per_step,
                                        start_cut=plan.cut + 1 if partial else plan.cut,
                                        wait_poll_ms=self.opts.wait_poll_ms, faults=self.faults,
                                        device=self.opts.device)
        self.timing["group_ready_ns"] = time.monotonic_ns()
        if self._replicated:
            return self._serve(plan)
        start = max(plan.cut, 0)
        for step in range(start, self.steps):
            self.watch.set_step(step, True)
            if self.faults.hit("step", step) == "cuda":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            self.wl.step(step, self.group)
            self.watch.set_step(step, False)
            if step == start:
                self._publish_timing(plan.gen)
        if start >= self.steps:
            self._publish_timing(plan.gen)
        final = self.group.barrier_cut()
        self.group.wait_key(P.commit_key(final), f"the commit of the final cut {final}")
        return EXIT_DONE

    def _serve(self, plan: P.Plan) -> int:
        """A replicated workload's rounds: the progress exchange (the boundary: prepare, then the allreduce
        of every rank's remaining work), then this rank's own decode. The first boundary where no rank has
        work left is the job's final cut (the prepare records say so: the coordinator knows it at the commit)."""
        g, first, cut = self.group, True, -1
        assert g is not None
        wl: Any = self.wl
        while True:
            cut = g.seq // g.every
            self.watch.set_step(cut, True)
            if self.faults.hit("step", cut) == "cuda":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            if wl.exchange(g) == 0:
                break
            wl.serve_round()
            self._flush_stamps()
            self.watch.set_step(cut, False)
            if first:
                self._publish_timing(plan.gen)
                first = False
        self.watch.set_step(cut, False)
        if first:
            self._publish_timing(plan.gen)
        self.store.set(P.done_key(self.rank), json.dumps(wl.result()))
        g.wait_key(P.commit_key(cut), f"the commit of the final cut {cut}")
        return EXIT_DONE

    def _serve_alone(self) -> None:
        """One round of this rank's own requests with no collective (a repair is under way)."""
        self.watch.set_step(-1, True)
        self.wl.serve_round()  # type: ignore[attr-defined]
        self._flush_stamps()
        self.watch.set_step(-1, False)

    def _flush_stamps(self) -> None:
        """Append this round's token stamps to ``stamps/<wid>.jsonl`` (one line per round, no fsync: it is a
        measurement, not state), so a process killed later still leaves what it served (tests, benchmarks)."""
        stamps: list[tuple[int, int, int]] = self.wl.stamps  # type: ignore[attr-defined]
        if self._stamps_out is None:
            (self.job_dir / "stamps").mkdir(exist_ok=True)
            self._stamps_out = open(self.job_dir / "stamps" / f"{self.wid}.jsonl", "a", buffering=1)
            self._stamps_out.write(json.dumps({"wid": self.wid, "rank": self.rank, "role": self.role}) + "\n")
        if len(stamps) > self._stamps_sent:
            self._stamps_out.write(json.dumps(stamps[self._stamps_sent:]) + "\n")
            self._stamps_sent = len(stamps)

    def _publish_timing(self, gen: int) -> None:
        self.timing["first_step_end_ns"] = time.monotonic_ns()
        self.timing["gen"] = gen
        self.store.set(P.timing_key(gen, self.wid), json.dumps(self.timing))

    def _cut(self, cut: int) -> None:
        """The boundary of cut ``cut``: the rank's prepare (called by the group before the collective)."""
        assert self.group is not None and self.epochs is not None
        if cut - 1 > self.resumed_cut:  # cuts commit in order: the plan's cut commits every one before it
            self.group.wait_key(P.commit_key(cut - 1), f"the commit of cut {cut - 1}")
        self.epochs.prepare(cut, before_append=lambda: self.faults.hit("prepare", cut))
        self.faults.hit("prepared", cut)
        if cut == self.steps:
            self.store.set(P.done_key(self.rank), json.dumps(self.wl.result()))
        record = f"{self.epochs.last_prepare_ms:.3f}"
        if self._replicated:
            record += f",{self.wl.remaining()}"  # type: ignore[attr-defined]
        self.store.set(P.prep_key(self.group.gen, cut, self.rank), record)
        self.faults.hit("uncommitted", cut)

    def _build(self, plan: P.Plan, *, serve: bool = False) -> Any:
        """The generation's group, built on a thread so that this one can leave if the generation moves
        (a member that died before joining would hold the rendezvous until the group's timeout). ``serve``
        (a partial plan): this thread serves the rank's own requests until the rendezvous completes.

        The build talks to the store through a client of its own. A TCPStore client serves one request at a
        time: while the rendezvous blocks in a ``get`` of a key the dead member never writes, every other call
        on that client waits behind it (measured: a ``check`` on the same client returned only when the
        blocked ``get`` timed out), so a shared client held the survivors' wait for the next plan for the
        group's whole timeout (30 s). An abandoned build keeps its client; nobody else waits on it."""
        out: dict[str, Any] = {}

        def make() -> None:
            try:
                self.faults.hit("rebuild", plan.cut)
                store = connect_store(self.port)
                out["pg"] = build_group(self.opts.backend, store, plan.gen, self.rank, plan.world,
                                        self.opts.collective_timeout_ms, self.opts.device)
            except Exception as e:  # noqa: BLE001 - reported as the generation's failure
                out["error"] = e

        th = threading.Thread(target=make, name="concordia-build", daemon=True)
        th.start()
        while th.is_alive():
            if serve and self.wl.remaining() > 0:  # type: ignore[attr-defined]
                self._serve_alone()
            else:
                th.join(self.opts.wait_poll_ms / 1e3)
            if self.watch.lost is not None:
                raise Interrupted("coordinator", self.watch.lost)
            if self.watch.gen > plan.gen:
                raise Interrupted("generation", f"generation {self.watch.gen} replaced {plan.gen} during rebuild")
        if "error" in out:
            raise Interrupted("collective", f"building the group of generation {plan.gen}: "
                              f"{str(out['error']).splitlines()[0][:300]}")
        return out["pg"]

    def _next_plan(self, gen: int, *, serve: bool = False) -> P.Plan | None:
        """Wait for a generation after ``gen`` (a store wait: wakes when the coordinator writes it).
        ``serve`` (a replicated workload): serve the rank's own requests between looks at the store."""
        deadline = time.monotonic() + self.opts.job_timeout_s
        while time.monotonic() < deadline:
            if self.watch.lost is not None:
                return None
            if serve and self.wl.remaining() > 0:  # type: ignore[attr-defined]
                if not self.store.check([P.plan_key(gen + 1)]):
                    self._serve_alone()
                    continue
            try:
                self.store.wait([P.plan_key(gen + 1)], timedelta(milliseconds=200))
            except (dist.DistStoreError, RuntimeError):
                if self.watch.lost is not None:
                    return None
                continue
            latest = int(self.store.get(P.GEN))
            return P.Plan.decode(self.store.get(P.plan_key(max(latest, gen + 1))))
        return None

    def _report(self, kind: str, message: str, gen: int, **extra: str) -> None:
        n = self.store.add(P.ERRORS, 1)
        self.store.set(P.err_key(n), json.dumps({"wid": self.wid, "rank": str(self.rank), "kind": kind,
                                                 "message": message, "gen": str(gen),
                                                 "at_ns": str(time.monotonic_ns()), **extra}))


def _wait_assignment(store: Any, wid: str) -> P.Plan:
    store.set(P.standby_key(wid), "ready")
    while True:
        try:
            store.wait([P.assign_key(wid)], timedelta(seconds=1))
            return P.Plan.decode(store.get(P.assign_key(wid)))
        except (dist.DistStoreError, RuntimeError) as e:
            if "timeout" not in str(e).lower():
                raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="concordia_ft.distributed.worker")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--wid", required=True)
    ap.add_argument("--role", choices=("rank", "hot", "warm"), required=True)
    ap.add_argument("--plan", default=None)
    a = ap.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is it stuck?
    job_dir = Path(a.job_dir)
    opts = DistOptions.from_json((job_dir / "options.json").read_text())
    torch.set_num_threads(1)
    if opts.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(opts.device))
    t0 = time.perf_counter()
    wl = build(opts)
    model_ms = (time.perf_counter() - t0) * 1e3
    if a.role == "warm":
        print("ready", flush=True)
        line = sys.stdin.readline()
        if not line:
            return EXIT_COORDINATOR
        plan = P.Plan.decode(line)
        member = Member(opts, job_dir, a.port, a.wid, wl, model_ms, "warm")
    elif a.role == "hot":
        member = Member(opts, job_dir, a.port, a.wid, wl, model_ms, "hot")
        plan = _wait_assignment(member.store, a.wid)
    else:
        member = Member(opts, job_dir, a.port, a.wid, wl, model_ms, "cold")
        plan = P.Plan.decode(a.plan)
    try:
        return member.run(plan)
    except Interrupted:
        return EXIT_COORDINATOR
    except Exception as e:
        kind, sticky, msg = classify_exception(e)
        print(f"worker {a.wid}: {kind} error (sticky={sticky}): {msg}", file=sys.stderr, flush=True)
        try:
            member._report(kind, msg, member.watch.gen, sticky="1" if sticky else "0")
        except Exception:  # noqa: BLE001 - the coordinator sees the exit either way
            return EXIT_ERROR
        if sticky:  # the coordinator kills this process (its context is poisoned) and replaces it
            time.sleep(member.opts.job_timeout_s)
        return EXIT_ERROR


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # daemon threads (heartbeat, abandoned group builds) must not hold the exit
