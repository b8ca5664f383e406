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
A member outlives its coordinator: when the coordinator dies it keeps its state and waits for the one its
supervisor starts again (``coord/endpoint.json``), offers itself for its rank and rejoins from the committed
cut (DESIGN.md §2); a standby exits (the new coordinator starts its own).
Exit codes: 0 done, 3 the coordinator is gone (and no new one came), 4 no longer a member (replaced), 1 an
error (reported).
"""

from __future__ import annotations

import time

STARTED_NS = time.monotonic_ns()  # before the heavy imports: a cold standby's start is measured from here
# after a store call failed: how long the coordinator's pidfd may take to fire before the failure is taken for
# something else (group.Watch.coordinator_dead)
STORE_LOSS_S = 2.0

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
from .group import (  # noqa: E402
    FaultInjector,
    FaultTolerantGroup,
    Interrupted,
    Watch,
    abort_retired,
    build_group,
    connect_store,
    launcher_dead,
)
from .health import classify_exception  # noqa: E402
from .options import DistOptions  # noqa: E402
from .workload import Workload, build, job_final_cut  # noqa: E402
from .workloads import state_digest  # noqa: E402

EXIT_DONE, EXIT_ERROR, EXIT_COORDINATOR, EXIT_REPLACED = 0, 1, 3, 4


class Member:
    """One process's life as a member of the job: restore, build, run, repair, repeat."""

    def __init__(self, opts: DistOptions, job_dir: Path, port: int, wid: str, wl: Workload, model_ms: float,
                 role: str, *, coordinator_pid: int, coord_inc: int) -> None:
        self.opts, self.job_dir, self.wid, self.wl, self.role = opts, job_dir, wid, wl, role
        self.port = port
        self.model_ms = model_ms
        self.store = connect_store(port)
        self.coord_inc = coord_inc  # the incarnation of the coordinator this process works for
        self.watch = Watch(port, wid, opts.heartbeat_ms, coordinator_pid=coordinator_pid)
        self.faults = FaultInjector(list(opts.faults), job_dir, wid)
        self.steps = job_final_cut(opts)  # the job's last cut
        self.epochs: RankEpochs | None = None
        self.rank = -1
        self.group: FaultTolerantGroup | None = None
        self.resumed_cut = -1
        self.timing: dict[str, Any] = {}
        self.spares: dict[tuple[int, int], Any] = {}  # (generation, failed rank) -> its spare group, connected
        self._spares_for = -1  # the generation whose spare groups this process built (or tried to)
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
                nxt: P.Plan | None = None
                why = e.reason
                if e.reason != "coordinator":
                    if e.reason == "collective":
                        self._report("collective", e.message, plan.gen)
                    nxt = self._next_plan(plan.gen, serve=self._replicated and self.opts.partial_service)
                if nxt is None:  # the coordinator died: wait for the one its supervisor starts, and rejoin it
                    got = self._reattach()
                    if isinstance(got, int):
                        return got
                    nxt, why = got, "coordinator"
            except Exception:
                if not self.watch.coordinator_dead(wait_s=STORE_LOSS_S):
                    raise
                # a store call failed because the coordinator (the store) died under it
                t_int = t_ab = time.monotonic_ns()
                abort_ms = self.group.abort() if self.group is not None else 0.0
                got = self._reattach()
                if isinstance(got, int):
                    return got
                nxt, why = got, "coordinator"
            if nxt.rank_of(self.wid) != self.rank:
                return EXIT_REPLACED
            assert self.epochs is not None
            if not self._partial(nxt):  # a partial plan keeps a survivor's state: nothing it did is undone
                self.epochs.rewind(nxt.cut, self.wl.initial_state())
            self.timing = {"wid": self.wid, "rank": self.rank, "role": "survivor", "interrupted_ns": t_int,
                           "interrupt": why, "abort_start_ns": t_int, "abort_end_ns": t_ab,
                           "abort_ms": abort_ms, "plan_seen_ns": time.monotonic_ns(), "resumed_cut": nxt.cut,
                           "failed_gen": plan.gen, "resume_digest": state_digest(self.wl.state())}
            plan = nxt
            self.faults.gen = plan.gen

    def _reattach(self) -> P.Plan | int:
        """The coordinator died: keep this process (its model, its state, its log) and wait for the coordinator
        its supervisor starts again on the job directory (``coord/endpoint.json`` names a newer incarnation),
        then offer itself for its rank (``adopt/<wid>``) and take the plan it is given (``assign/<wid>``).
        Gives up (an exit code) when the launcher dies, or no coordinator comes within ``coordinator_grace_s``."""
        self.watch.stop()
        deadline = time.monotonic() + self.opts.coordinator_grace_s
        while True:
            ep = wait_endpoint(self.job_dir, newer_than=self.coord_inc, deadline=deadline)
            if ep is None:
                return EXIT_COORDINATOR
            self.coord_inc = int(ep["inc"])
            try:
                self.port = int(ep["port"])
                self.store = connect_store(self.port)
                self.watch = Watch(self.port, self.wid, self.opts.heartbeat_ms, coordinator_pid=int(ep["pid"]))
                assert self.epochs is not None
                self.store.set(P.adopt_key(self.wid), json.dumps({"rank": self.rank,
                                                                  "slots": self.epochs.slot_cuts}))
                plan = _wait_assignment(self.store, self.wid, self.watch, standby=False)
            except Exception:  # noqa: BLE001 - that coordinator died too: wait for the next one
                if self.watch.coordinator_dead(wait_s=STORE_LOSS_S):
                    continue
                raise
            if plan is None:
                continue
            self.faults.gen = plan.gen
            return plan

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
        sp = plan.extra.get("spare")
        pg = self.spares.pop((int(sp["gen"]), int(sp["failed"])), None) if sp else None
        self.timing["spare"] = pg is not None
        self._drop_spares()  # the others name a dead process, or an older generation's members
        if pg is None:
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
        abort_retired()  # the generation made its first step: the old communicators can go now

    def _cut(self, cut: int) -> None:
        """The boundary of cut ``cut``: the rank's prepare (called by the group before the collective)."""
        assert self.group is not None and self.epochs is not None
        if cut - 1 > self.resumed_cut:  # cuts commit in order: the plan's cut commits every one before it
            self.group.wait_key(P.commit_key(cut - 1), f"the commit of cut {cut - 1}")
        self._member_spares(cut)
        self.epochs.prepare(cut, before_append=lambda: self.faults.hit("prepare", cut))
        self.faults.hit("prepared", cut)
        if cut == self.steps:
            self.store.set(P.done_key(self.rank), json.dumps(self.wl.result()))
        record = f"{self.epochs.last_prepare_ms:.3f}"
        if self._replicated:
            record += f",{self.wl.remaining()}"  # type: ignore[attr-defined]
        self.store.set(P.prep_key(self.group.gen, cut, self.rank), record)
        self.faults.hit("uncommitted", cut)

    # ---------------------------------------------------------------------------------- spare groups
    def _member_spares(self, cut: int) -> None:
        """At the boundary the coordinator named (``spare/<gen>``), build this member's spare groups: one per
        other rank the ready hot standby could replace (DESIGN.md §5c), on a helper thread, leaving if the
        generation moves (a death during the build is repaired the ordinary way)."""
        g = self.group
        if not self.opts.standby.preconnect or g is None or self._spares_for >= g.gen:
            return
        key = P.spare_key(g.gen)
        if not self.store.check([key]):
            return
        doc = json.loads(self.store.get(key))
        if int(doc["at_cut"]) != cut:
            return
        self._spares_for = g.gen
        sid, world = str(doc["standby"]), g.world
        todo = [(f, P.spare_prefix(g.gen, sid, f)) for f in range(world) if f != self.rank]
        self.watch.waiting_ns = time.monotonic_ns()  # waiting on the others' builds, not computing
        try:
            self._run_builds(g.gen, todo, self.rank, world, lambda: self.watch.gen > g.gen,
                             f"the spare groups of generation {g.gen}")
        finally:
            self.watch.waiting_ns = 0

    def _standby_spares(self, doc: dict[str, Any]) -> None:
        """A hot standby told to connect ahead (``sparefor/<wid>``): build the group for each rank it could
        replace, in rank order (the members build theirs in the same order: no build waits on another), on a
        thread: the standby keeps waiting for its assignment meanwhile."""
        gen, world = int(doc["gen"]), len(doc["members"])
        self._spares_for = gen
        todo = [(f, P.spare_prefix(gen, self.wid, f)) for f in range(world)]

        def work() -> None:
            self._run_builds(gen, todo, None, world, lambda: False, f"the spare groups of generation {gen}")

        threading.Thread(target=work, name="concordia-spares", daemon=True).start()

    def _run_builds(self, gen: int, todo: list[tuple[int, str]], rank: int | None, world: int,
                    moved: Any, what: str) -> dict[tuple[int, int], Any] | None:
        """Build ``todo``'s groups (failed rank, store prefix) one after another on a helper thread with a
        store client of its own; say ``spareok/<gen>/<wid>`` ok or failed. Returns them, or None if the
        generation moved (``moved()``) or a build failed."""
        out: dict[str, Any] = {}

        def make() -> None:
            store = connect_store(self.port)
            try:
                pgs = {}
                for f, prefix in todo:
                    pgs[(gen, f)] = build_group(self.opts.backend, store, prefix, f if rank is None else rank,
                                                world, self.opts.collective_timeout_ms, self.opts.device)
                out["pgs"] = pgs
                self.spares.update(pgs)  # before "ok": the coordinator uses them once every process said ok
                store.set(P.spare_ok_key(gen, self.wid), "ok")
            except Exception as e:  # noqa: BLE001 - reported; repairs then build their group as before
                out["error"] = e
                try:
                    store.set(P.spare_ok_key(gen, self.wid), f"failed: {str(e).splitlines()[0][:200]}")
                except Exception:  # noqa: BLE001 - the coordinator is gone: nothing to tell
                    pass

        th = threading.Thread(target=make, name="concordia-spare-build", daemon=True)
        th.start()
        while th.is_alive():
            th.join(self.opts.wait_poll_ms / 1e3)
            if rank is not None and self.watch.lost is not None:
                raise Interrupted("coordinator", self.watch.lost)
            if moved():
                raise Interrupted("generation", f"the generation moved while building {what}")
        return out.get("pgs")

    def _drop_spares(self) -> None:
        for pg in self.spares.values():
            FaultTolerantGroup.retire(pg, self.opts.backend)
        self.spares = {}

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
                out["pg"] = build_group(self.opts.backend, store, f"pg/{plan.gen}", self.rank, plan.world,
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


def _wait_assignment(store: Any, wid: str, watch: Watch, *, standby: bool = True,
                     member: Member | None = None) -> P.Plan | None:
    """A hot standby's (or a rank offered to a new coordinator's) wait for its plan; None: the coordinator died.
    A hot standby (``member``) told to connect ahead builds its spare groups meanwhile."""
    if standby:
        store.set(P.standby_key(wid), "ready")
    while True:
        if watch.coordinator_dead():
            return None
        if member is not None and store.check([P.spare_for_key(wid)]):
            doc = json.loads(store.get(P.spare_for_key(wid)))
            if int(doc["gen"]) > member._spares_for:
                member._drop_spares()
                member._standby_spares(doc)
        try:
            store.wait([P.assign_key(wid)], timedelta(milliseconds=200))
            return P.Plan.decode(store.get(P.assign_key(wid)))
        except (dist.DistStoreError, RuntimeError) as e:
            if "timeout" not in str(e).lower():
                if watch.coordinator_dead(wait_s=STORE_LOSS_S):
                    return None
                raise


def wait_endpoint(job_dir: Path, *, newer_than: int, deadline: float) -> dict[str, Any] | None:
    """The endpoint of a coordinator incarnation newer than ``newer_than`` once it is up (its pid alive), or
    None at the deadline or when the job's launcher has died (nobody will start one)."""
    path = job_dir / "coord" / "endpoint.json"
    while time.monotonic() < deadline:
        if launcher_dead():
            return None
        try:
            ep = json.loads(path.read_text())
            if int(ep["inc"]) > newer_than and os.path.exists(f"/proc/{int(ep['pid'])}"):
                return ep  # type: ignore[no-any-return]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    return None

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="concordia_ft.distributed.worker")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--wid", required=True)
    ap.add_argument("--role", choices=("rank", "hot", "warm"), required=True)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--coordinator-pid", type=int, required=True)
    ap.add_argument("--inc", type=int, required=True, help="the coordinator's incarnation")
    a = ap.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is it stuck?
    job_dir = Path(a.job_dir)
    opts = DistOptions.from_json((job_dir / "options.json").read_text())
    torch.set_num_threads(1)
    if opts.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(opts.device))
    t0 = time.perf_counter()
    wl = build(opts)
    if a.role in ("hot", "warm"):
        wl.warmup()  # a standby pays the first-call costs now, not in the repair's first step
    model_ms = (time.perf_counter() - t0) * 1e3
    who = {"coordinator_pid": a.coordinator_pid, "coord_inc": a.inc}
    if a.role == "warm":
        print("ready", flush=True)
        line = sys.stdin.readline()
        if not line:
            return EXIT_COORDINATOR
        plan = P.Plan.decode(line)
        member = Member(opts, job_dir, a.port, a.wid, wl, model_ms, "warm", **who)
    elif a.role == "hot":
        member = Member(opts, job_dir, a.port, a.wid, wl, model_ms, "hot", **who)
        got = _wait_assignment(member.store, a.wid, member.watch, member=member)
        if got is None:
            return EXIT_COORDINATOR  # a standby is not kept across coordinators: the new one starts its own
        plan = got
    else:
        member = Member(opts, job_dir, a.port, a.wid, wl, model_ms, "cold", **who)
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
