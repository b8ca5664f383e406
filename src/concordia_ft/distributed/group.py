"""The fault-tolerant process group: torch.distributed collectives of one generation, cut at boundaries.

``FaultTolerantGroup`` wraps one generation's torch process group (``ProcessGroupGloo`` or
``ProcessGroupNCCL`` built on a store prefix of its own, ``pg/<gen>``). Every collective:

1. counts itself; every ``every``-th one is a boundary: before it is issued, ``on_cut(cut)`` runs (the
   rank's prepare), so the application never asks for a checkpoint;
2. is issued asynchronously on a private copy of the tensor and waited for in slices of ``wait_poll_ms``,
   looking at the generation between slices: a collective whose peer died or hung is abandoned within the
   slice once the coordinator has moved the generation, never waited on until the peer answers;
3. raises ``Interrupted`` (a collective error, or the generation moved); the caller aborts the group
   (``abort()``: bounded, DESIGN.md §5), rebuilds the next generation's group and replays from the cut.

``Watch`` is the process's heartbeat thread: its own store connection, a beat every ``heartbeat_ms`` and the
current generation read back each beat (so a blocked wait learns of a repair without a store round trip).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import protocol as P
from .health import Beat
from .timeline import stamp_fault

_GRAVEYARD: list[Any] = []  # abandoned groups: never destroyed while one of their collectives may still run
_ABORT_LATER: list[Any] = []  # NCCL communicators to abort once the next generation has made its first step


class Interrupted(Exception):
    """A collective or a wait of this generation was abandoned; ``reason``: 'collective' or 'generation'."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def connect_store(port: int, timeout_s: float = 30.0) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed re-exports it without __all__
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


LAUNCHER_ENV = "CONCORDIA_DIST_LAUNCHER_PID"  # run_job's pid: when it dies the whole job goes with it


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError:  # gone already (or no pidfds: then the store's failure tells)
        return None


def _fired(fd: int | None, wait_s: float = 0.0) -> bool:
    return fd is not None and bool(select.select([fd], [], [], wait_s)[0])


_LAUNCHER_FD = _pidfd(int(os.environ[LAUNCHER_ENV])) if os.environ.get(LAUNCHER_ENV, "").isdigit() else None


def launcher_dead() -> bool:
    """The process that launched the job (``run_job``) has died: no coordinator will be started again."""
    return _fired(_LAUNCHER_FD)


class Watch:
    """Heartbeat + generation watch on a thread of its own (with its own store client), and the coordinator's
    and the launcher's lives (pidfds: their deaths are events, seen within one heartbeat period at most)."""

    def __init__(self, port: int, wid: str, heartbeat_ms: int, *, coordinator_pid: int) -> None:
        self.wid = wid
        self.period_s = heartbeat_ms / 1e3
        self.coord_fd = _pidfd(coordinator_pid)
        self.store = connect_store(port)
        self.gen = -1
        self.step = -1
        self.in_step = False
        self.step_started_ns = 0
        self.waiting_ns = 0  # when the collective this process is blocked in was issued (0: not in one)
        self.recent_ms: list[float] = []
        self.lost: str | None = None  # the store went away (the coordinator died)
        self._stop = threading.Event()
        self._changed = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._loop, name=f"concordia-watch-{wid}", daemon=True)
        self._thread.start()

    def coordinator_dead(self, wait_s: float = 0.0) -> bool:
        """The coordinator is gone (its store lost, or its pidfd fired). ``wait_s``: after a store call failed,
        how long its pidfd may take to fire: a SIGKILLed process's sockets are closed before it becomes a zombie
        (the kernel's exit path), so a survivor's call can fail first; under load, by milliseconds or more."""
        return self.lost is not None or _fired(self.coord_fd, wait_s)

    def beat(self) -> None:
        now = time.monotonic_ns()
        self.store.set(P.hb_key(self.wid), Beat(now, self.step, self.in_step, self.step_started_ns,
                                                max(self.recent_ms, default=0.0), self.waiting_ns).encode())
        if self.store.check([P.GEN]):
            g = int(self.store.get(P.GEN))
            if g != self.gen:
                self.gen = g
                self._changed.set()

    def _loop(self) -> None:
        fds = [fd for fd in (self.coord_fd, _LAUNCHER_FD) if fd is not None]
        while not self._stop.is_set():
            hit: list[int] = []
            if fds:
                hit = select.select(fds, [], [], self.period_s)[0]
            else:
                self._stop.wait(self.period_s)
            if self._stop.is_set():
                return
            if _LAUNCHER_FD is not None and _LAUNCHER_FD in hit:
                os._exit(3)  # the launcher is gone: nobody restarts the coordinator, nobody reads the result
            if self.coord_fd is not None and self.coord_fd in hit:
                self.lost = "the coordinator died"
                self._changed.set()
                return
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 - the store is gone: the coordinator died
                self.lost = f"the coordinator's store is unreachable ({e})"
                self._changed.set()
                return

    def set_step(self, step: int, in_step: bool) -> None:
        now = time.monotonic_ns()
        if not in_step and self.in_step:
            self.recent_ms = [*self.recent_ms[-15:], (now - self.step_started_ns) / 1e6]
        self.step, self.in_step = step, in_step
        if in_step:
            self.step_started_ns = now

    def wait_change(self, timeout_s: float) -> bool:
        hit = self._changed.wait(timeout_s)
        self._changed.clear()
        return hit

    def stop(self) -> None:
        self._stop.set()


class FaultInjector:
    """Faults injected where they happen: a rank SIGKILLs itself at a named point of a named cut.

    Points: ``collective`` (a boundary collective issued, in flight), ``prepare`` (state copied into the slot,
    before its epoch is appended), ``prepared`` (the epoch durable, its store record not yet published),
    ``uncommitted`` (published, the commit not yet seen), ``rebuild`` (inside the next group's construction),
    ``restore`` (a replacement opening the dead rank's log), ``step`` (local compute). Each fault fires once per
    job, also across replacements and coordinator restarts: the first process to create ``faults/fired.<i>`` in
    the job directory fires it. Before it fires, the fault is stamped in ``faults.jsonl`` (``stamp_fault``), so
    its repair's phases are measured from the moment it happened.

    ``action``: ``kill`` (SIGKILL, the default), ``stop`` (SIGSTOP: a hung process, heartbeats stop),
    ``error`` (point ``collective`` only: the collective's result is replaced by an error, as a broken link
    gives, while the peers' halves stay in flight), ``cuda`` (the step raises the error torch raises after an
    illegal address, CUDA error 700: sticky)."""

    def __init__(self, faults: list[dict[str, Any]], job_dir: Path, wid: str) -> None:
        self.faults = faults
        self.job_dir = job_dir
        self.wid = wid
        self.rank = -1
        self.gen = 0

    def hit(self, point: str, cut: int) -> str | None:
        """Fire the faults set for this point; returns the action the caller must take (error, cuda)."""
        for i, f in enumerate(self.faults):
            if f["point"] != point or int(f["rank"]) != self.rank:
                continue
            if "cut" in f and int(f["cut"]) != cut:
                continue
            if "min_gen" in f and self.gen < int(f["min_gen"]):
                continue
            if not _claim(self.job_dir / "faults" / f"fired.{i}"):
                continue
            action = str(f.get("action", "kill"))
            stamp_fault(self.job_dir, self.wid, f"{action} at {point} of cut {cut}", by=f"rank {self.rank}")
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                return action
        return None


def _claim(path: Path) -> bool:
    path.parent.mkdir(exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


def build_group(backend: str, store: Any, prefix_name: str, rank: int, world: int, timeout_ms: int,
                device: str) -> Any:
    """A fresh torch process group on its own store prefix (``pg/<gen>``, or a spare's: never an old one),
    connected: NCCL's first collective (its lazy connect) is paid here, not by the first step."""
    prefix = dist.PrefixStore(prefix_name, store)  # type: ignore[attr-defined]  # re-exported without __all__
    timeout = timedelta(milliseconds=timeout_ms)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
    x = torch.zeros(1, device=device)
    work = pg.allreduce([x])  # type: ignore[attr-defined]  # the C++ class's method, absent from torch's stubs  # connect now: the first step must not pay for it
    while not work.is_completed():  # never a device-wide synchronize: an aborted group's kernel may still spin
        time.sleep(0.0005)
    work.wait()
    return pg


class FaultTolerantGroup:
    """Collectives of one generation; every ``every``-th collective is a checkpoint boundary."""

    def __init__(self, pg: Any, *, store: Any, backend: str, gen: int, rank: int, world: int, watch: Watch,
                 on_cut: Callable[[int], None], every: int, start_cut: int, wait_poll_ms: float,
                 faults: FaultInjector | None = None, device: str = "cpu") -> None:
        self.pg = pg
        self.store = store  # the main thread's client (the watch thread has its own)
        self.backend = backend
        self.gen = gen
        self.rank = rank
        self.world = world
        self.watch = watch
        self.on_cut = on_cut
        self.every = every
        self.seq = max(0, start_cut) * every  # collectives issued since cut 0
        self.poll_s = wait_poll_ms / 1e3
        self.faults = faults
        self.device = device
        self.aborted = False

    # ------------------------------------------------------------------------------------------ public
    def allreduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place."""
        cut = self._boundary()
        buf = t.detach().clone()
        work = self.pg.allreduce([buf])
        if cut is not None and self.faults is not None and self.faults.hit("collective", cut) == "error":
            raise Interrupted("collective", f"allreduce failed on rank {self.rank}: injected link error")
        self._await(work, "allreduce")
        t.copy_(buf)

    def barrier_cut(self) -> int:
        """A collective that is a boundary whatever the count: the final cut of a job. Returns that cut."""
        self.seq = -(-self.seq // self.every) * self.every
        cut = self.seq // self.every
        self.allreduce(torch.zeros(1, device=self.device))
        return cut

    def check_generation(self) -> None:
        if self.watch.lost is not None:
            raise Interrupted("coordinator", self.watch.lost)
        if self.watch.gen > self.gen:  # the watch may not have seen this generation yet: only newer counts
            raise Interrupted("generation", f"generation {self.watch.gen} replaced {self.gen}")

    def wait_key(self, key: str, what: str) -> None:
        """Wait for a store key, in slices, leaving as soon as the generation moves."""
        store = self.store
        while True:
            self.check_generation()
            try:
                store.wait([key], timedelta(seconds=self.poll_s))
                return
            except dist.DistStoreError:
                continue
            except RuntimeError as e:
                if "timeout" in str(e).lower():
                    continue
                raise Interrupted("coordinator", f"waiting for {what}: {e}") from None

    @staticmethod
    def retire(pg: Any, backend: str) -> None:
        """Drop a group nobody uses any more (a spare that will not be needed): kept alive in the graveyard,
        NCCL's aborted on a thread of its own (frees its buffers; the caller never waits for it)."""
        _GRAVEYARD.append(pg)
        if backend == "nccl":
            _ABORT_LATER.append(pg)

    def abort(self) -> float:
        """Leave the communicator; returns the ms the calling thread spent. Gloo's abort does not release a
        blocked collective (measured), so the group is moved to a graveyard and dropped; NCCL's abort (0.5-1 s,
        measured) runs on a thread of its own: the caller never waits for it, nor for the dead peer."""
        t0 = time.perf_counter()
        if not self.aborted:
            self.aborted = True
            pg = self.pg
            _GRAVEYARD.append(pg)
            if self.backend == "nccl":
                _ABORT_LATER.append(pg)  # after the next generation's first step: abort_retired()
            else:
                _abort_quietly(pg)
        return (time.perf_counter() - t0) * 1e3

    # ----------------------------------------------------------------------------------------- private
    def _boundary(self) -> int | None:
        self.check_generation()
        cut = self.seq // self.every if self.seq % self.every == 0 else None
        self.seq += 1
        if cut is not None:
            self.on_cut(cut)
        return cut

    def _await(self, work: Any, what: str) -> None:
        """Wait for a collective, in slices; the heartbeat says this process is waiting on its peers (so a
        peer's hang is never blamed on it: health.classify_silence)."""
        self.watch.waiting_ns = time.monotonic_ns()
        try:
            if self.backend == "nccl":
                self._await_nccl(work, what)
            else:
                self._await_gloo(work, what)
        finally:
            self.watch.waiting_ns = 0

    def _await_gloo(self, work: Any, what: str) -> None:
        done = threading.Event()
        fut = work.get_future()
        fut.add_done_callback(lambda _f: done.set())
        while not done.wait(self.poll_s):
            self.check_generation()
        try:
            fut.value()
        except Exception as e:  # noqa: BLE001 - any backend error: the group is broken
            raise Interrupted("collective", f"{what} failed on rank {self.rank}: {str(e).splitlines()[0][:300]}"
                              ) from None

    def _await_nccl(self, work: Any, what: str) -> None:
        """A NCCL work's future completes when the collective is enqueued (a CUDA future: its value is ready
        in stream order), so waiting on it, or synchronising the stream, would wait on a dead peer's kernel
        (seen on the H200: the survivor never left). ``is_completed()`` queries the work's end event without
        blocking: poll it, and look at the generation between polls."""
        next_check = time.monotonic() + self.poll_s
        while not work.is_completed():
            time.sleep(0.0002)
            if time.monotonic() >= next_check:
                self.check_generation()
                next_check = time.monotonic() + self.poll_s
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - ncclRemoteError & co: the group is broken
            raise Interrupted("collective", f"{what} failed on rank {self.rank}: {str(e).splitlines()[0][:300]}"
                              ) from None


def abort_retired() -> None:
    """Abort the NCCL communicators left behind (on a thread: NCCL's abort takes 0.5-1 s, measured). Called
    once the new generation has made its first step: run during the repair, the abort competes with the
    repair's first step (on the H200 that step took 0.5-0.6 s where a steady step takes milliseconds)."""
    while _ABORT_LATER:
        threading.Thread(target=_abort_quietly, args=(_ABORT_LATER.pop(),), daemon=True).start()


def _abort_quietly(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - an abort that fails leaves the group as broken as before
        pass
