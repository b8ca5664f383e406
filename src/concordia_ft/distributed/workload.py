"""Your own loop as a distributed job: the ``Workload`` contract, how a job names one, and the checks a job
passes before anything starts.

A workload is a class (or a factory) that every rank process builds with the job's ``seed``, ``world``,
``steps``, ``device`` and ``workload_args``; the runtime then drives it (worker.py):

- ``bind(rank)`` once a process knows which rank it holds (a standby builds the model before it knows);
- ``state()``: the tensors that ARE the rank's state (parameters being trained, optimizer moments, a KV cache,
  the tokens so far). They are registered in the rank's log and restored in place, so ``state()`` must return
  the same tensors every time (update them in place, never rebind them);
- ``initial_state()``: the same tensors' values before step 0 (a rank rewinds to them before the first cut);
- ``step(step, group)``: one step; every collective goes through ``group.allreduce(t)`` (in place, a sum), and
  every ``collectives_per_step``-th call is the epoch boundary: before it is issued, the runtime commits the
  state as it was at the top of the step (cut ``step``). Work before a step's first collective must be a
  function of the state and the step number (a recovered rank replays the step from the top: same bits);
- ``result()``: a JSON-able summary (the job's result per rank: losses, tokens, a digest of the state);
- ``warmup()`` (optional): the step's code run once locally by a standby before it says it is ready.

Class attributes and class methods, all optional: ``collectives_per_step`` (1), ``replicated`` (False: ranks
share one state; True: each rank serves independently, DESIGN.md §5b), ``final_cut(steps, args)`` (the
number of steps, default ``steps``: the job's last cut), ``check(world, steps, args)`` (raise ``ConfigError``
when the shape does not fit the world: the job is refused before any process starts).

``DistOptions.workload`` names it: a built-in (``dp_lora``, ``tp_decode``, ``replica_serve``: workloads.py,
written against this same contract), ``"package.module:Name"``, or the class / function itself (it must be
importable by that path in a fresh process: defined at the top level of a module, not in ``__main__``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError
from .options import BUILTIN, workload_path  # noqa: F401 - the names a DistOptions resolves, re-exported here

if TYPE_CHECKING:
    import torch

    from .options import DistOptions

FINAL_UNKNOWN = 1 << 62  # a replicated job's final cut: announced by the ranks when no work is left


class Group(Protocol):
    """What a workload's ``step`` is given (group.FaultTolerantGroup): collectives of the current generation."""

    def allreduce(self, t: torch.Tensor) -> None: ...


class Workload:
    """A base class for your own loop (the module docstring is the contract). Subclass it, keep the keyword
    arguments, and name it ``"module:Class"`` in ``DistOptions.workload`` or ``--workload``."""

    collectives_per_step = 1
    replicated = False

    def __init__(self, *, seed: int, world: int, steps: int, device: str = "cpu") -> None:
        self.seed, self.world, self.steps, self.device = seed, world, steps, device
        self.rank = -1

    @classmethod
    def final_cut(cls, steps: int, args: Mapping[str, Any]) -> int:
        return steps

    @classmethod
    def check(cls, world: int, steps: int, args: Mapping[str, Any]) -> None:
        return None

    def bind(self, rank: int) -> None:
        self.rank = rank

    def state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def initial_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def step(self, step: int, group: Group) -> None:
        raise NotImplementedError

    def result(self) -> dict[str, Any]:
        return {}

    def warmup(self) -> None:
        """Optional: run the step's code once, locally, before a standby says it is ready (first-call costs:
        autograd's threads, cuBLAS handles, kernels loaded on first use), so a replacement's first step costs
        what any step costs. The state it leaves is overwritten by the restore."""
        return None


def resolve(spec: str) -> Callable[..., Any]:
    """The class or factory a workload name stands for (imports its module)."""
    path = BUILTIN.get(spec, spec)
    if ":" not in path:
        raise ConfigError(f"unknown workload {spec!r}: use one of {', '.join(BUILTIN)}, or 'module:function' for "
                          "your own loop (README, 'Your own training or decode loop')")
    mod_name, _, qual = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"workload {spec!r}: cannot import module {mod_name!r} ({e}); is it on PYTHONPATH "
                          "(or in the directory you run from)?") from None
    for part in qual.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"workload {spec!r}: module {mod_name!r} has no {qual!r}")
    if not callable(obj):
        raise ConfigError(f"workload {spec!r}: {qual} is not a class or a function")
    return obj  # type: ignore[no-any-return]


def job_final_cut(opts: DistOptions) -> int:
    """The job's last cut (= its number of steps), the same in the coordinator and in every rank."""
    target = resolve(opts.workload)
    if getattr(target, "replicated", False):
        return FINAL_UNKNOWN
    fc = getattr(target, "final_cut", None)
    return int(fc(opts.steps, dict(opts.workload_args))) if fc is not None else opts.steps


def build(opts: DistOptions) -> Any:
    """The workload of this job, built (a rank's or a standby's "model load")."""
    target = resolve(opts.workload)
    try:
        return target(seed=opts.seed, world=opts.world, steps=opts.steps, device=opts.device,
                      **dict(opts.workload_args))
    except TypeError as e:
        raise ConfigError(f"workload {opts.workload}: bad argument ({e})") from None


def validate(opts: DistOptions) -> None:
    """Refuse a job that cannot run, before any process starts, with the cause: the workload's name, its
    arguments and its shape against the world (``check``), and every scheduled kill against the world and the
    job's cuts (a kill that could never fire is refused)."""
    target = resolve(opts.workload)
    try:
        inspect.signature(target).bind(seed=opts.seed, world=opts.world, steps=opts.steps, device=opts.device,
                                       **dict(opts.workload_args))
    except TypeError as e:
        raise ConfigError(f"workload {opts.workload}: bad argument ({e})") from None
    except ValueError:
        pass  # no signature to look at (a builtin): the ranks find out
    check = getattr(target, "check", None)
    if check is not None:
        check(opts.world, opts.steps, dict(opts.workload_args))
    final = job_final_cut(opts)
    for k in opts.kills:
        rank, cut = int(k["rank"]), int(k["after_cut"])
        if not 0 <= rank < opts.world:
            raise ConfigError(f"kill of rank {rank} after cut {cut}: the world has ranks 0..{opts.world - 1}")
        if cut < 0:
            raise ConfigError(f"kill of rank {rank} after cut {cut}: cuts start at 0")
        if final != FINAL_UNKNOWN and cut >= final:
            raise ConfigError(f"kill of rank {rank} after cut {cut}: the job's last cut is {final} (its steps), so "
                              f"the kill could never fire; use a cut in 0..{final - 1}")
