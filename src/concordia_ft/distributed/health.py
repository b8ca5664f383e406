"""What failed and what to do about it: pure decisions, the clock passed in (no sleeping, no I/O).

The coordinator feeds these functions what it observed (a pidfd that fired, heartbeat stamps, error reports
from ranks) and acts on the ``Verdict``. Kinds and actions (DESIGN.md §4):

- ``PROCESS_DEATH`` (the pid exited: SIGKILL, OOM killer, a crash): REPLACE the rank from its log.
- ``HANG`` (pid alive, heartbeats stopped for ``heartbeat_timeout_ms``, or heartbeats alive but no step for
  ``progress_timeout_ms`` while it is in a step): KILL it (SIGKILL, bounded) and REPLACE.
- ``COLLECTIVE_ERROR`` (a rank's collective failed and no death explains it within ``collective_grace_ms``):
  REBUILD the group with the same members (a new group on a new store prefix); repeated on one rank: REPLACE.
- ``STICKY_CUDA`` (a rank reported a CUDA error that poisons its context, errors.DeviceError.sticky): KILL and
  REPLACE (the context cannot be used again in that process).
- a rank that loses the coordinator (the store) exits; a restarted coordinator resumes the job from its commit
  log (RESTART_ALL): the store never lives in a rank, so a rank's death never takes the store with it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..cuda.driver import STICKY_CODES
from ..errors import DeviceError
from .options import DistOptions

# the CUDA runtime's message for each sticky driver code (what torch raises: "CUDA error: <message>")
STICKY_MESSAGES = {
    "an illegal memory access was encountered": 700,
    "the launch timed out and was terminated": 702,
    "hardware stack error": 714,
    "an illegal instruction was encountered": 715,
    "misaligned address": 716,
    "operation not supported on global/shared address space": 717,
    "invalid program counter": 718,
    "unspecified launch failure": 719,
    "uncorrectable ecc error encountered": 214,
}


class FailureKind(str, enum.Enum):
    PROCESS_DEATH = "process-death"
    HANG = "hang"
    COLLECTIVE_ERROR = "collective-error"
    STICKY_CUDA = "sticky-cuda"


class Action(str, enum.Enum):
    REPLACE = "replace"  # a standby (or a new process) takes the rank, restored from the rank's log
    KILL_REPLACE = "kill-replace"  # SIGKILL the process first (hung or poisoned), then REPLACE
    REBUILD = "rebuild"  # same members, new communicator, rewind to the committed cut


ACTIONS = {
    FailureKind.PROCESS_DEATH: Action.REPLACE,
    FailureKind.HANG: Action.KILL_REPLACE,
    FailureKind.COLLECTIVE_ERROR: Action.REBUILD,
    FailureKind.STICKY_CUDA: Action.KILL_REPLACE,
}


@dataclass(frozen=True)
class Verdict:
    kind: FailureKind
    rank: int
    action: Action
    detail: str


@dataclass(frozen=True)
class Timeouts:
    """The detection timeouts in force, derived from measured step times by ``plan_timeouts``."""

    heartbeat_timeout_ms: float
    progress_timeout_ms: float
    slowest_step_ms: float  # the measurement they came from (0: none yet)
    stopped_ms: float = 100.0  # a process the kernel shows stopped this long is hung (no step time matters)


def plan_timeouts(step_ms: Sequence[float], opts: DistOptions) -> Timeouts:
    """Heartbeat timeout: ``heartbeat_misses`` periods (a scheduling hiccup on a loaded host must not kill a
    healthy rank; a stopped process misses every beat). Progress timeout: ``hang_factor`` times the slowest
    of the recent steps, never below ``min_progress_timeout_ms`` (before any step is measured, the floor)."""
    slowest = max(step_ms) if step_ms else 0.0
    return Timeouts(float(opts.heartbeat_ms * opts.heartbeat_misses),
                    max(float(opts.min_progress_timeout_ms), opts.hang_factor * slowest), slowest,
                    float(2 * opts.heartbeat_ms))


@dataclass(frozen=True)
class Beat:
    """One heartbeat as a rank writes it: when (monotonic ns), its step, and whether it is inside a step."""

    at_ns: int
    step: int
    in_step: bool
    step_started_ns: int
    slowest_step_ms: float = 0.0  # the slowest of the rank's recent steps (the timeouts' measurement)
    waiting_ns: int = 0  # when the collective it is blocked in was issued (0: computing, not waiting on peers)

    def encode(self) -> bytes:
        return (f"{self.at_ns},{self.step},{int(self.in_step)},{self.step_started_ns},"
                f"{self.slowest_step_ms:.3f},{self.waiting_ns}").encode()

    @classmethod
    def decode(cls, raw: bytes) -> Beat:
        a, s, i, t, m, w = raw.decode().split(",")
        return cls(int(a), int(s), i == "1", int(t), float(m), int(w))


def classify_silence(rank: int, beat: Beat | None, seen_ns: int, now_ns: int, t: Timeouts) -> Verdict | None:
    """A live pid that has gone quiet or stopped progressing, or None. ``seen_ns``: when the coordinator
    last saw this beat change (so a clock offset between processes does not matter). A rank blocked in a
    collective is waiting on a peer, not hung itself: the progress timeout never blames it (the peer that is
    stopped or stuck in its own compute is the one found; every rank waiting at once: ``classify_wedged``)."""
    quiet_ms = (now_ns - seen_ns) / 1e6
    if quiet_ms > t.heartbeat_timeout_ms:
        return Verdict(FailureKind.HANG, rank, Action.KILL_REPLACE,
                       f"rank {rank} sent no heartbeat for {quiet_ms:.0f} ms (timeout {t.heartbeat_timeout_ms:.0f}"
                       " ms): the process is stopped or wedged")
    if beat is not None and beat.in_step and not beat.waiting_ns:
        busy_ms = (beat.at_ns - beat.step_started_ns) / 1e6
        if busy_ms > t.progress_timeout_ms:
            return Verdict(FailureKind.HANG, rank, Action.KILL_REPLACE,
                           f"rank {rank} has been in step {beat.step} for {busy_ms:.0f} ms (timeout "
                           f"{t.progress_timeout_ms:.0f} ms = max(floor, factor x slowest step "
                           f"{t.slowest_step_ms:.1f} ms))")
    return None


def classify_stopped(rank: int, state: str, stopped_since_ns: int, now_ns: int, t: Timeouts) -> Verdict | None:
    """A process the kernel reports stopped (``/proc/<pid>/stat`` state ``T``: SIGSTOP, SIGTSTP) for longer
    than ``t.stopped_ms``: hung for certain, whatever its peers do (a slow process is never in that state)."""
    if state != "T" or not stopped_since_ns:
        return None
    ms = (now_ns - stopped_since_ns) / 1e6
    if ms < t.stopped_ms:
        return None
    return Verdict(FailureKind.HANG, rank, Action.KILL_REPLACE,
                   f"rank {rank} is stopped (process state T for {ms:.0f} ms): SIGSTOP or a debugger")


def classify_wedged(beats: Sequence[Beat | None], now_ns: int, t: Timeouts) -> Verdict | None:
    """Every member alive, beating, and blocked in a collective for longer than the progress timeout: nobody
    computes and nobody is stopped, so the communicator itself is stuck (a lost message, a wedged link):
    REBUILD it with the same members."""
    if not beats or any(b is None or not b.in_step or not b.waiting_ns for b in beats):
        return None
    oldest = min(b.waiting_ns for b in beats if b is not None)
    waited_ms = (max(b.at_ns for b in beats if b is not None) - oldest) / 1e6
    if waited_ms <= t.progress_timeout_ms:
        return None
    return Verdict(FailureKind.COLLECTIVE_ERROR, -1, Action.REBUILD,
                   f"every rank has waited in a collective for {waited_ms:.0f} ms (timeout "
                   f"{t.progress_timeout_ms:.0f} ms) with every process alive: the communicator is stuck")


def classify_exception(e: BaseException) -> tuple[str, bool, str]:
    """(kind, sticky, message) of an exception raised by a rank's step: ``cuda`` (sticky when the code is in
    the driver's must-restart table), ``collective`` (a torch.distributed backend error) or ``error``."""
    msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if isinstance(e, DeviceError):
        return "cuda", e.sticky, msg
    low = msg.lower()
    if "cuda error" in low:
        code = next((c for m, c in STICKY_MESSAGES.items() if m in low), None)
        if code is not None:
            return "cuda", True, f"{msg} ({STICKY_CODES[code]}, code {code}: the context is poisoned)"
        return "cuda", False, msg
    if type(e).__name__ in ("DistBackendError", "DistNetworkError") or "nccl" in low or "gloo" in low:
        return "collective", False, msg
    return "error", False, msg


def classify_report(rank: int, report: Mapping[str, str], since_ns: int, now_ns: int, opts: DistOptions,
                    dead: Sequence[int]) -> Verdict | None:
    """A rank's own error report. A collective error waits ``collective_grace_ms`` for a death to explain it
    (then the death is the verdict, not this); a sticky CUDA error is acted on at once."""
    kind = report.get("kind", "")
    if kind == "cuda" and report.get("sticky") == "1":
        return Verdict(FailureKind.STICKY_CUDA, rank, Action.KILL_REPLACE,
                       f"rank {rank}: {report.get('message', 'sticky CUDA error')}")
    if kind in ("collective", "cuda"):
        if dead:
            return None
        if (now_ns - since_ns) / 1e6 < opts.collective_grace_ms:
            return None
        return Verdict(FailureKind.COLLECTIVE_ERROR, rank, Action.REBUILD,
                       f"rank {rank}: {report.get('message', 'collective failed')} (no peer died within "
                       f"{opts.collective_grace_ms} ms)")
    return None
