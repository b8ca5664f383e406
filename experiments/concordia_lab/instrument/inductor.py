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

Protocol 4 (done bits): one control block per launch, as the module global is per module: a kernel launched
twice in one call of ``f`` is refused (``InstrumentError``), since both launches would share its done bits, or
with ``repeated="skip"`` left disarmed and listed in ``skipped``, or armed ``"per_launch"`` (a stream write of
its global before each launch).

Protocol 5 ("record on pause", the default): one arena for the call, aligned to a power of two, with one
64-byte header (pause word, mode word) that every armed kernel reaches by masking its control pointer, and one
region of per-block records ``(s, rem)`` per *kernel*, shared by all its launches in the call: a block that
sees the pause adds one to its ``s`` and leaves, and since the pause is sticky a block skipped a suffix of the
kernel's launches. Nothing is written per launch or per call while running (no memset, no stream writes): an
armed call with no pause leaves every record zero. ``set_pause(True)`` (or ``GpuPauseTrigger``) writes the one
pause word; ``pending()`` says per launch which blocks still have to run; ``begin_resume()`` clears the pause,
sets the resume mode and each block's countdown ``rem`` (how many of its kernel's launches have that block),
then calling ``f`` again runs exactly the skipped (kernel, block, launch) triples in call order (a pause during
the resume leaves the rest pending again); ``end_resume()`` returns to run mode once nothing is pending.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InstrumentError
from .safepoints import (
    CTL_BITMAP,
    CTL_PAUSE,
    HARG_PREFIX,
    HDR_BYTES,
    HDR_MODE,
    HDR_PAUSE,
    MODE_RESUME,
    MODE_RUN,
    PROTO_PREFIX,
    SYMBOL_PREFIX,
    ctl_bytes,
    pending_blocks,
    v5_ctl_value,
    v5_region_bytes,
    v5_totals,
)

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


def _route(k: KernelLaunch) -> int:
    """A header_arg kernel's route: the alignment its Triton launcher passes to the profile allocator."""
    from . import header_arg

    binary = k.launcher.__globals__.get("bin") if k.launcher is not None else None
    route = int(getattr(getattr(binary, "metadata", None), "profile_scratch_align", 0) or 0)
    if not header_arg.is_route(route):
        raise InstrumentError(f"{k.name} has a header_arg marker but its launcher's metadata names no route "
                              f"(profile_scratch_align={route:#x}): compiled by another hook version? recompile")
    return route


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
    """One armed launch's control state, for pausing it: what ``pause.GpuPauseTrigger.arm`` takes (``ctl``,
    ``nblocks``, ``pause_ptr``, ``protocol``), the pending blocks after a pause, and the pause word. Protocol 4:
    ``ctl`` is the launch's control block; protocol 5: the call's arena (its header's pause word is word 0)."""

    name: str
    nblocks: int
    ctl: Any  # int32 view of the arena
    protocol: int = 4
    owner: Any = None  # the ArmedLaunches (protocol 5)
    index: int = 0

    @property
    def pause_ptr(self) -> int:
        return int(self.ctl.data_ptr()) + (HDR_PAUSE if self.protocol == 5 else CTL_PAUSE)

    def pending(self) -> list[int]:
        if self.protocol == 5:
            return list(self.owner.pending()[self.index])
        words = self.ctl[CTL_BITMAP // 4:].cpu().numpy().view("uint32").tolist()
        return pending_blocks(words, self.nblocks)

    def set_pause(self, on: bool) -> None:
        """Write the pause word on the current stream (``on`` False: protocol 4's next armed call resumes;
        protocol 5 resumes through ``ArmedLaunches.begin_resume()``)."""
        w = (HDR_PAUSE if self.protocol == 5 else CTL_PAUSE) // 4
        self.ctl[w:w + 1].fill_(1 if on else 0)


@dataclass
class _Kernel5:
    """Protocol 5: one kernel of the call, its launches, its record region."""

    name: str
    glob: int  # address of its cft_ctl_ global
    launches: list[int]  # indexes into ArmedLaunches.launches, in call order
    grids: list[int]  # block counts of those launches
    offset: int = 0  # byte offset of its records in the arena


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
        self.protocol = 4
        self.header_arg = False  # some kernel takes its header from a parameter (SafepointOptions.header_arg)
        self._routes: dict[int, str] = {}  # header_arg: each such kernel's route (header_arg.route_of) -> name
        self._k5: dict[int, _Kernel5] = {}
        protos: dict[int, int] = {}
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
            if k.function not in protos:
                protos[k.function] = 5 if int(drv.cuModuleGetGlobal(mod, (PROTO_PREFIX + k.name).encode())[0]) == 0 \
                    else 4
            if protos[k.function] == 5 and int(drv.cuModuleGetGlobal(mod, (HARG_PREFIX + k.name).encode())[0]) == 0:
                if k.static:
                    raise InstrumentError(f"{k.name} takes its header from a kernel parameter, and Inductor's "
                                          "static launcher passes none: set torch._inductor.config."
                                          "use_static_triton_launcher = False before compiling (triton_hook."
                                          "install does, when torch is imported before it)")
                self.header_arg = True
                self._routes[_route(k)] = k.name
            if protos[k.function] == 5:
                k5 = self._k5.setdefault(k.function, _Kernel5(k.name, ptr, [], []))
                k5.launches.append(len(self.launches))
                k5.grids.append(k.nblocks)
                self.launches.append(k)
                continue
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
        if self._k5 and (offsets or self._repeat):
            raise InstrumentError("this call mixes kernels compiled with probe protocols 4 and 5 (two hook "
                                  "options in one process?): compile every kernel with one SafepointOptions")
        if self._k5:
            self.protocol = 5
            self._arm5(dev)
            return
        self.arena = torch.zeros(max(words, ALIGN_WORDS), dtype=torch.int32, device=dev)
        self._offsets = offsets
        if self._repeat:
            from concordia_ft.cuda import driver as cd

            if not cd.device_attribute("CAN_USE_64_BIT_STREAM_MEM_OPS"):
                raise InstrumentError("arming per launch needs 64-bit stream memory operations, which this "
                                      "device or driver does not offer: use repeated='skip'")
        for fn, occ in self._repeat.items():
            self._wrap(fn, occ)

    def _arm5(self, dev: Any) -> None:
        import torch  # noqa: TID251 - the GPU host side, like pause.py

        from .pause import aligned_arena

        off = HDR_BYTES
        for k5 in self._k5.values():
            k5.offset = off
            off += v5_region_bytes(max(k5.grids))
        self.arena, self._backing, self._align = aligned_arena(off, dev)
        # each block's resume countdown: how many of its kernel's launches have it
        self._totals = {fn: torch.tensor(v5_totals(k5.grids, max(k5.grids)), dtype=torch.int32, device=dev)
                        for fn, k5 in self._k5.items()}

    def records(self, fn: int) -> Any:
        """Protocol 5: the (s, rem) records of kernel ``fn`` (a CUfunction), an (nblocks, 2) int32 view."""
        k5 = self._k5[fn]
        n = max(k5.grids)
        return self.arena[k5.offset // 4: k5.offset // 4 + 2 * n].view(n, 2)

    def pending(self) -> list[list[int]]:
        """Per launch, the blocks still to run (protocol 5: from the skip records; 4: from the done bits)."""
        import numpy as np
        import torch  # noqa: TID251

        torch.cuda.synchronize()
        if self.protocol == 4:
            return [self.view(i).pending() for i in range(len(self.launches))]
        out: list[list[int]] = [[] for _ in self.launches]
        for fn, k5 in self._k5.items():
            s = self.records(fn)[:, 0].cpu().numpy().astype(np.int64)
            grids = np.asarray(k5.grids)
            for j, i in enumerate(k5.launches):
                g = int(grids[j])
                later = np.sort(grids[j:])
                place = len(later) - np.searchsorted(later, np.arange(g), side="right")  # from the end
                sb = s[:g]
                out[i] = np.nonzero((sb > 0) & (place <= sb))[0].tolist()
        return out

    def set_pause(self, on: bool = True) -> None:
        """Protocol 5: write the call's one pause word on the current stream (every armed kernel sees it)."""
        self._need5()
        self.arena[HDR_PAUSE // 4:HDR_PAUSE // 4 + 1].fill_(1 if on else 0)

    def request_pause(self) -> None:
        """Protocol 5: pause a call that is running now: one write of the header's pause word from a stream of
        its own (a stream memory operation needs no SM, so it lands while the call's kernels hold them all).
        ``set_pause`` instead writes in the current stream's order (before or after a call, never inside it)."""
        from concordia_ft.cuda.driver import Stream

        from .pause import _check, _drv

        self._need5()
        drv = _drv()
        if getattr(self, "_side", None) is None:
            self._side = Stream.create(non_blocking=True)
        _check(drv.cuStreamWriteValue32(self._side.handle, self.arena.data_ptr() + HDR_PAUSE, 1, 0),
               "cuStreamWriteValue32(pause)")

    def begin_resume(self) -> None:
        """Protocol 5, after a paused call drained: clear the pause, enter resume mode and set every block's
        countdown, on the current stream; then call the compiled function again (same inputs): exactly the
        skipped blocks of each launch run, in call order."""
        self._need5()
        self.arena[HDR_PAUSE // 4:HDR_PAUSE // 4 + 1].zero_()
        self.arena[HDR_MODE // 4:HDR_MODE // 4 + 1].fill_(MODE_RESUME)
        for fn, tot in self._totals.items():
            self.records(fn)[:, 1].copy_(tot)

    def end_resume(self) -> int:
        """Protocol 5, after a resuming call drained: back to run mode if nothing is pending; returns how many
        (launch, block) pairs are still pending (then resume again)."""
        self._need5()
        left = sum(len(p) for p in self.pending())
        if left == 0:
            self.arena[HDR_MODE // 4:HDR_MODE // 4 + 1].fill_(MODE_RUN)
        return left

    def _need5(self) -> None:
        if self.protocol != 5:
            raise InstrumentError("set_pause/begin_resume/end_resume are protocol 5's; a protocol-4 call pauses "
                                  "through view(i).set_pause and resumes by calling again without reset()")

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
        """Launch ``i``'s control block (a view of the arena; protocol 5: the arena, header first)."""
        if self.protocol == 5:
            return self.arena
        n = ctl_bytes(self.launches[i].nblocks) // 4
        return self.arena[self._offsets[i]:self._offsets[i] + n]

    def view(self, i: int) -> ControlView:
        """Launch ``i``'s control block as a ``ControlView``. Protocol 4: a call of the compiled function made
        while armed and without ``reset()`` is a resume: blocks whose done bit is set leave at entry."""
        return ControlView(self.launches[i].name, self.launches[i].nblocks, self.ctl(i), self.protocol, self, i)

    def arm(self, on: bool = True) -> None:
        import numpy as np

        from .pause import _check, _drv

        drv = _drv()
        if self.protocol == 5:  # one write per kernel, whatever its launch count
            if self.header_arg:
                from . import header_arg

                if on:  # first, so that a kernel another armed call holds is refused before any global changes
                    header_arg.activate(self.arena.data_ptr(), self, self._backing, self._routes)
                else:
                    header_arg.deactivate(self)
            self._armed = on
            for k5 in self._k5.values():
                ptr = v5_ctl_value(self.arena.data_ptr() + k5.offset, self._align) if on else 0
                value = np.array([ptr], dtype=np.uint64)
                _check(drv.cuMemcpyHtoD(k5.glob, value.ctypes.data, 8), f"write {SYMBOL_PREFIX}{k5.name}")
            return
        self._armed = on
        for i, g in enumerate(self._globals):
            value = np.array([self.ctl(i).data_ptr() if on else 0], dtype=np.uint64)
            _check(drv.cuMemcpyHtoD(g, value.ctypes.data, 8), f"write {SYMBOL_PREFIX}{self.launches[i].name}")

    def disarm(self) -> None:
        self.arm(False)

    def reset(self) -> None:
        """Zero the control state on the current stream. Protocol 4: before every armed call (done bits);
        protocol 5: only to abandon a paused call (an armed call that was not paused leaves it zero)."""
        self.arena.zero_()
        for fn in self._next:
            self._next[fn] = 0

    def done_counts(self) -> list[int]:
        """Blocks of each launch that ran (protocol 4: done bits set; 5: blocks not pending)."""
        import torch  # noqa: TID251 - the GPU host side, like pause.py

        torch.cuda.synchronize()
        if self.protocol == 5:
            return [k.nblocks - len(p) for k, p in zip(self.launches, self.pending(), strict=True)]
        out = []
        for i in range(len(self.launches)):
            bits = self.ctl(i)[CTL_BITMAP // 4:].cpu().numpy().view("uint32")
            out.append(int(sum(bin(int(w)).count("1") for w in bits)))
        return out
