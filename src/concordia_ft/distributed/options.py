"""The distributed job's knobs, in one typed place (units in every name).

``DistOptions`` is accepted as an object or a dict (``DistOptions.coerce``); it travels to every rank and
standby as JSON, so every process of a job reads the same values. How each timeout is derived from measured
step times is in DESIGN.md §4 (``plan_timeouts`` in ``health.py`` is the one place that does it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.options import coerce_options
from ..errors import ConfigError

BACKENDS = ("gloo", "nccl")
POOL_KINDS = ("hot", "warm", "cold")
ON_FAILURE = ("repair", "restart")


BUILTIN = {"dp_lora": "concordia_ft.distributed.workloads:DpLora",
           "tp_decode": "concordia_ft.distributed.workloads:TpDecode",
           "replica_serve": "concordia_ft.distributed.workloads:ReplicaServe"}


def workload_path(spec: Any) -> str:
    """The name a job's processes resolve: a built-in's name, ``module:qualname``, or the path of a class or
    function (which must be importable from a fresh process)."""
    if isinstance(spec, str):
        if not spec:
            raise ConfigError("workload '': name a built-in (" + ", ".join(BUILTIN) + ") or 'module:function'")
        return spec
    if not callable(spec):
        raise ConfigError(f"workload {spec!r}: pass a name, 'module:function', or the class / function itself")
    mod, qual = getattr(spec, "__module__", None), getattr(spec, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual:
        raise ConfigError(f"workload {qual or spec!r}: the job's rank processes import it by path, so define it at "
                          "the top level of an importable module (not in __main__, a function or a lambda)")
    return f"{mod}:{qual}"



@dataclass(frozen=True)
class StandbyOptions:
    """The standby pool: ``hot`` processes are up, model built, connected to the store and waiting for an
    assignment; ``warm`` ones are up with the model built but not connected (told through a pipe); ``cold``
    means a new process is started when needed. ``order`` is the preference when a rank must be replaced;
    ``refill`` starts a new standby of the kind just used, in the background, after each repair; ``preconnect``
    connects a ready hot standby to the ranks ahead of a failure (spare groups)."""

    hot: int = 1
    warm: int = 0
    order: tuple[str, ...] = ("hot", "warm", "cold")
    refill: bool = True
    # a ready hot standby and the ranks build, ahead of any failure and at one step boundary, one spare group
    # per rank the standby could replace (the ranks but that one, the standby in its place); a repair then
    # switches to the spare: no group is built on its critical path (DESIGN.md §5c). Costs `world` more
    # communicators per process (NCCL: their buffers in GPU memory) and one build at a boundary each time a
    # standby becomes ready; False builds the new group during the repair
    preconnect: bool = True

    def __post_init__(self) -> None:
        if self.hot < 0 or self.warm < 0:
            raise ConfigError(f"standby counts must be >= 0, got hot={self.hot} warm={self.warm}")
        bad = [k for k in self.order if k not in POOL_KINDS]
        if bad or not self.order:
            raise ConfigError(f"standby order {self.order!r}: use a non-empty sequence of {', '.join(POOL_KINDS)}")
        object.__setattr__(self, "order", tuple(self.order))


@dataclass(frozen=True)
class DistOptions:
    """One distributed job: its workload, its world, its detection and recovery knobs."""

    # a built-in (dp_lora | tp_decode | replica_serve), "module:Name", or the class / factory itself (workload.py)
    workload: Any = "dp_lora"
    world: int = 4
    steps: int = 40  # training steps / tokens to decode
    seed: int = 1234
    backend: str = "gloo"
    device: str = "cpu"  # "cpu" or "cuda:0" (every rank of a one-GPU NCCL test shares cuda:0)
    fsync: str = "always"  # the ranks' and the coordinator's log policy (core/log.py)
    on_failure: str = "repair"  # repair: replace the rank in place; restart: kill all, start all (baseline)
    standby: StandbyOptions = field(default_factory=StandbyOptions)
    heartbeat_ms: int = 50  # each process's heartbeat period (a thread with its own store connection)
    heartbeat_misses: int = 40  # heartbeats missed before a live pid is declared hung (unresponsive)
    poll_ms: float = 2.0  # the coordinator's store poll period (process death is event-driven: pidfd)
    wait_poll_ms: float = 5.0  # a rank's wait slice: how often a blocked wait looks at the generation
    hang_factor: float = 50.0  # progress timeout = hang_factor x the slowest recent step (DESIGN.md §4)
    min_progress_timeout_ms: int = 2000  # floor of that timeout (the first steps have no measurement yet)
    collective_timeout_ms: int = 30000  # the torch group's own timeout: frees an abandoned collective's threads; also
    # bounds a rendezvous nobody abandons (fresh processes starting 9 s apart on a loaded 2-core host: 5 s was
    # too short there and cost a needless rebuild in bench_distributed)
    collective_grace_ms: int = 200  # after a collective error, how long to wait for a death to explain it
    abort_bound_ms: int = 50  # a survivor leaves a broken communicator within this bound (asserted in tests)
    max_rebuilds: int = 8  # repairs of one step before the job gives up (a failure that repeats)
    job_timeout_s: float = 600.0
    # how long a rank whose coordinator died waits for the one a supervisor starts again on the job directory,
    # then rejoins it with its state (it exits at once when run_job, the launcher, dies: nobody will restart it)
    coordinator_grace_s: float = 60.0
    workload_args: dict[str, Any] = field(default_factory=dict)
    # replicated workloads (replica_serve): survivors keep serving their own requests while a dead rank's
    # replacement is restored, and join the new group at their next boundary without rewinding (DESIGN.md
    # §5b); False: they rewind to the committed cut and wait, as data-parallel ranks must (the baseline)
    partial_service: bool = True
    # fault injection (tests, benchmarks): faults a rank injects into itself (group.FaultInjector), kills the
    # coordinator sends at chosen cuts (``kills``: {"after_cut", "rank"}) or at random times (``chaos``:
    # {"kills", "seed", "min_delay_ms", "max_delay_ms"})
    faults: tuple[dict[str, Any], ...] = ()
    kills: tuple[dict[str, Any], ...] = ()
    chaos: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:

        object.__setattr__(self, "workload", workload_path(self.workload))
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if self.on_failure not in ON_FAILURE:
            raise ConfigError(f"on_failure {self.on_failure!r}: use one of {', '.join(ON_FAILURE)}")
        if self.world < 1:
            raise ConfigError(f"world must be >= 1, got {self.world}")
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        for name in ("heartbeat_ms", "heartbeat_misses", "collective_timeout_ms", "min_progress_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.backend == "nccl" and not self.device.startswith("cuda"):
            raise ConfigError("backend 'nccl' needs device='cuda:N'")
        if self.max_rebuilds < 0 or self.job_timeout_s <= 0:
            raise ConfigError(f"max_rebuilds must be >= 0 and job_timeout_s > 0, got {self.max_rebuilds}, "
                              f"{self.job_timeout_s}")
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "kills", tuple(self.kills))
        for k in self.kills:
            if not isinstance(k, Mapping) or set(k) != {"rank", "after_cut"}:
                raise ConfigError(f"kill {k!r}: use {{'rank': R, 'after_cut': C}}")
        _check_chaos(self.chaos)
        if isinstance(self.standby, Mapping):
            object.__setattr__(self, "standby", coerce_options(StandbyOptions, self.standby, "standby"))

    @classmethod
    def coerce(cls, value: DistOptions | Mapping[str, Any] | None) -> DistOptions:
        return coerce_options(cls, value, "distributed")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DistOptions:
        d = json.loads(text)
        d["standby"] = StandbyOptions(**{**d["standby"], "order": tuple(d["standby"]["order"])})
        return cls(**d)


CHAOS_KEYS = {"kills": 0, "seed": 0, "min_delay_ms": 20.0, "max_delay_ms": 400.0}


def _check_chaos(chaos: Mapping[str, Any]) -> None:
    bad = set(chaos) - set(CHAOS_KEYS)
    if bad:
        raise ConfigError(f"chaos {sorted(bad)}: unknown; use {', '.join(CHAOS_KEYS)}")
    kills = chaos.get("kills", 0)
    if not isinstance(kills, int) or kills < 0:
        raise ConfigError(f"chaos kills must be a count >= 0, got {kills!r}")
    lo, hi = (float(chaos.get(k, CHAOS_KEYS[k])) for k in ("min_delay_ms", "max_delay_ms"))
    if not 0 <= lo <= hi:
        raise ConfigError(f"chaos delays: need 0 <= min_delay_ms <= max_delay_ms, got {lo} and {hi}")
