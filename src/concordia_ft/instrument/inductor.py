"""Arming the safe points of the Triton kernels inside an Inductor-compiled function (the host side).

A function compiled by ``torch.compile`` while ``triton_hook.install()`` is active runs kernels that carry
probes, launched by Inductor's own launcher (the static CUDA launcher or Triton's), which keeps the loaded
module to itself. ``capture_launches(f, inputs)`` runs ``f`` once and records, for every kernel launch: the
``CachingAutotuner``, the arguments (cloned at launch), the grid and the ``CUfunction`` the launcher passed to
the driver (wrapping the launcher's ``runner`` for that one call). ``ArmedLaunches`` then finds each kernel's
``cft_ctl_<kernel>`` module global through ``cuFuncGetModule`` + ``cuModuleGetGlobal`` and points it at its
own control block in one device arena:

- ``arm()`` / ``disarm()``: write the globals (armed: every probe loads its pause word and done bit, and every
  block sets its done bit at exit: the probes' full cost);
- ``reset()``: zero the arena on the current stream (one memset); a launch sequence armed with done bits left
  from an earlier call would skip every block, so an armed caller resets before each call;
- ``done_counts()``: blocks that recorded themselves, per launch (after an armed call: all of them).

One control block per kernel, as the module global is per module: a kernel launched twice in one call of ``f``
is refused (``InstrumentError``), since both launches would share its done bits, or with ``repeated="skip"``
left disarmed and listed in ``skipped``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InstrumentError
from .safepoints import CTL_BITMAP, CTL_PAUSE, SYMBOL_PREFIX, ctl_bytes, pending_blocks

ALIGN_WORDS = 16  # 64-byte aligned control blocks


@dataclass
class KernelLaunch:
    name: str  # the kernel's entry name (its module global is cft_ctl_<name>)
    autotuner: Any  # torch._inductor CachingAutotuner
    args: list[Any]  # the positional arguments of CachingAutotuner.run, tensors cloned at launch
    grid: tuple[int, int, int]
    function: int  # the CUfunction handle the launcher passed to the driver
    static: bool  # launched by Inductor's static CUDA launcher (else Triton's)
    launcher: Any = None  # the Inductor launcher that made this launch (its globals hold the runner)

    @property
    def nblocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def _launch_target(launcher: Any, runner: Any) -> tuple[int, str, bool]:
    """(CUfunction, kernel name, static?) of one Inductor launcher (torch 2.11-2.13 layouts)."""
    while hasattr(runner, "__wrapped__"):  # a runner wrapped by ArmedLaunches
        runner = runner.__wrapped__
    owner = getattr(runner, "__self__", None)
    fn = getattr(owner, "function", None) if owner is not None else None
    if fn is not None:  # StaticallyLaunched*Kernel.run, bound
        return int(fn), str(getattr(owner, "name", "")), True
    scope = launcher.__globals__
    fn = scope.get("function")
    binary = scope.get("bin")
    if fn is None or binary is None:
        raise InstrumentError("an Inductor launcher without a CUfunction in its scope: this torch version lays "
                              "its launchers out differently (instrument/inductor.py reads 2.11-2.13's)")
    name = getattr(binary, "name", None) or binary.metadata.name
    return int(fn), str(name), False


def capture_launches(f: Callable[..., Any], inputs: Sequence[Any]) -> list[KernelLaunch]:
    """Run ``f(*inputs)`` once (no grad) and record every Inductor kernel launch, in order. ``f`` must have
    run before under no_grad, so that its kernels are compiled and autotuned (else ``InstrumentError``)."""
    import torch  # noqa: TID251 - the GPU host side, like pause.py
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner  # noqa: TID251

    seen: list[KernelLaunch] = []
    orig: Any = CachingAutotuner.run

    untuned: list[str] = []

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(self.launchers) != 1:  # compiling or autotuning now: its benchmark launches are no call's
            untuned.append(self.fn.__name__)
            return orig(self, *args, **kwargs)
        cloned = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        swapped = []
        for launcher in self.launchers:
            scope = launcher.__globals__
            inner = scope["runner"]

            def rec(*rargs: Any, _inner: Any = inner, _launcher: Any = launcher) -> Any:
                fn, name, static = _launch_target(_launcher, _inner)
                grid = (int(rargs[0]), int(rargs[1]), int(rargs[2]))
                seen.append(KernelLaunch(name or self.fn.__name__, self, cloned, grid, fn, static, _launcher))
                return _inner(*rargs)

            scope["runner"] = rec
            swapped.append((scope, inner))
        try:
            return orig(self, *args, **kwargs)
        finally:
            for scope, inner in swapped:
                scope["runner"] = inner

    CachingAutotuner.run = run  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            f(*inputs)
        torch.cuda.synchronize()
    finally:
        CachingAutotuner.run = orig  # type: ignore[method-assign]
    if untuned:
        raise InstrumentError(f"capture_launches: {sorted(set(untuned))} compiled or autotuned during the captured "
                              "call; run f once before, in the same grad mode (capture_launches calls it under "
                              "torch.no_grad(), and grad mode is one of Dynamo's guards)")
    return seen


@dataclass
class ControlView:
    """One armed launch's control block, for pausing it: what ``pause.GpuPauseTrigger.arm`` takes (``ctl``,
    ``nblocks``), the pending blocks after a pause, and clearing the pause word before the resuming call."""

    name: str
    nblocks: int
    ctl: Any  # int32 view of the arena

    def pending(self) -> list[int]:
        words = self.ctl[CTL_BITMAP // 4:].cpu().numpy().view("uint32").tolist()
        return pending_blocks(words, self.nblocks)

    def set_pause(self, on: bool) -> None:
        """Write the pause word on the current stream (``on`` False: the next armed call resumes)."""
        self.ctl[CTL_PAUSE // 4:CTL_PAUSE // 4 + 1].fill_(1 if on else 0)


class ArmedLaunches:
    """Control blocks for the instrumented kernels among ``launches`` (one call of a compiled function)."""

    def __init__(self, launches: Sequence[KernelLaunch], *, repeated: str = "raise") -> None:
        """repeated: what to do with a kernel launched more than once per call: "raise"; "skip" (leave all its
        launches disarmed, listed in ``skipped``); or "per_launch": every launch gets its own control block and
        the launcher's runner is wrapped so that, while armed, each launch is preceded on its stream by a
        stream memory write (``cuStreamWriteValue64``) pointing the module global at that launch's block
        (occurrences counted from ``reset()``)."""
        import torch  # noqa: TID251 - the GPU host side, like pause.py

        from .pause import _check, _drv

        drv = _drv()
        self.launches: list[KernelLaunch] = []
        self.skipped: dict[str, str] = {}  # kernel -> why it is not armed (no probes: refused or not Triton's)
        self.with_probes: list[str] = []  # kernels whose module has the global (armed or not)
        self._globals: list[int] = []
        offsets: list[int] = []
        words = 0
        count: dict[int, int] = {}
        self._repeat: dict[int, list[tuple[int, int, KernelLaunch]]] = {}  # fn -> (launch index, global, launch)
        self._next: dict[int, int] = {}
        self._armed = False
        for k in launches:
            count[k.function] = count.get(k.function, 0) + 1
        for k in launches:
            mod = _check(drv.cuFuncGetModule(k.function), f"cuFuncGetModule({k.name})")
            res = drv.cuModuleGetGlobal(mod, (SYMBOL_PREFIX + k.name).encode())
            if int(res[0]) != 0:
                self.skipped[k.name] = "no cft_ctl_ global: compiled without probes, or refused by the rewriter"
                continue
            ptr, size = int(res[1]), int(res[2])
            if size != 8:
                raise InstrumentError(f"{SYMBOL_PREFIX}{k.name} is {size} bytes, expected 8")
            if k.name not in self.with_probes:
                self.with_probes.append(k.name)
            if count[k.function] > 1 and repeated == "per_launch":
                self._repeat.setdefault(k.function, []).append((len(self.launches), ptr, k))
            elif count[k.function] > 1:
                why = (f"launched {count[k.function]} times per call: its one module global cannot give each "
                       "launch its own done bits")
                if repeated != "skip":
                    raise InstrumentError(f"{k.name} is {why}; arm such kernels per launch")
                self.skipped[k.name] = why
                continue
            self.launches.append(k)
            self._globals.append(ptr)
            offsets.append(words)
            n = ctl_bytes(k.nblocks) // 4
            words += -(-n // ALIGN_WORDS) * ALIGN_WORDS
        dev = next((a.device for k in launches for a in k.args if isinstance(a, torch.Tensor)),
                   torch.device("cuda"))
        self.arena = torch.zeros(max(words, ALIGN_WORDS), dtype=torch.int32, device=dev)
        self._offsets = offsets
        if self._repeat:
            from ..cuda import driver as cd

            if not cd.device_attribute("CAN_USE_64_BIT_STREAM_MEM_OPS"):
                raise InstrumentError("arming per launch needs 64-bit stream memory operations, which this "
                                      "device or driver does not offer: use repeated='skip'")
        for fn, occ in self._repeat.items():
            self._wrap(fn, occ)

    def _wrap(self, fn: int, occ: list[tuple[int, int, KernelLaunch]]) -> None:
        from .pause import _check, _drv

        launcher = occ[0][2].launcher
        if launcher is None:
            raise InstrumentError(f"{occ[0][2].name}: its launcher was not captured; cannot arm it per launch")
        scope = launcher.__globals__
        inner = scope["runner"]
        drv = _drv()
        ptrs = [(g, i) for i, g, _ in occ]
        self._next[fn] = 0

        def runner(*rargs: Any) -> Any:
            if self._armed:
                j = self._next[fn] % len(ptrs)
                self._next[fn] = j + 1
                g, i = ptrs[j]
                _check(drv.cuStreamWriteValue64(int(rargs[3]), g, self.ctl(i).data_ptr(), 0),
                       f"cuStreamWriteValue64({SYMBOL_PREFIX}{occ[0][2].name})")
            return inner(*rargs)

        runner.__wrapped__ = inner  # type: ignore[attr-defined]
        scope["runner"] = runner

    def ctl(self, i: int) -> Any:
        """Launch ``i``'s control block (a view of the arena)."""
        n = ctl_bytes(self.launches[i].nblocks) // 4
        return self.arena[self._offsets[i]:self._offsets[i] + n]

    def view(self, i: int) -> ControlView:
        """Launch ``i``'s control block as a ``ControlView``. A call of the compiled function made while
        armed and without ``reset()`` is a resume: blocks whose done bit is set leave at entry, the rest run."""
        return ControlView(self.launches[i].name, self.launches[i].nblocks, self.ctl(i))

    def arm(self, on: bool = True) -> None:
        import numpy as np

        from .pause import _check, _drv

        drv = _drv()
        self._armed = on
        for i, g in enumerate(self._globals):
            value = np.array([self.ctl(i).data_ptr() if on else 0], dtype=np.uint64)
            _check(drv.cuMemcpyHtoD(g, value.ctypes.data, 8), f"write {SYMBOL_PREFIX}{self.launches[i].name}")

    def disarm(self) -> None:
        self.arm(False)

    def reset(self) -> None:
        self.arena.zero_()
        for fn in self._next:
            self._next[fn] = 0

    def done_counts(self) -> list[int]:
        """Blocks of each launch whose done bit is set."""
        import torch  # noqa: TID251 - the GPU host side, like pause.py

        torch.cuda.synchronize()
        out = []
        for i in range(len(self.launches)):
            bits = self.ctl(i)[CTL_BITMAP // 4:].cpu().numpy().view("uint32")
            out.append(int(sum(bin(int(w)).count("1") for w in bits)))
        return out
