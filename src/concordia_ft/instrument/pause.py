"""Cooperative pause and resume of a Triton kernel launch at block granularity (the host side).

A kernel compiled after ``triton_hook.install()`` carries the probes of ``safepoints``. ``PausableLaunch``
owns one launch of it:

- ``start()`` zeroes a control block in device memory (pause word + one "done" bit per block), points the
  kernel's ``cft_ctl_<name>`` module global at it and launches the full grid on the current torch stream;
- ``request_pause()`` writes the pause word from a separate non-blocking stream (a stream memory op: no SM
  is needed, so it lands while the kernel holds every SM); blocks that have not started yet see it at entry,
  record their bit and leave; blocks past entry run to completion (or, at a restartable barrier, leave and
  rerun later). ``drain()`` waits for the launch to end: the pause latency is bounded by one block's run;
- ``pending()`` decodes the bitmap: exactly the blocks that still have to run;
- ``resume()`` relaunches the same full grid in resume mode: blocks whose bit is clear exit at once,
  the others clear their bit and run (XSched's design; ``%ctaid``/``%nctaid`` keep their meaning);
- ``checkpoint(rt)`` makes the paused state — arguments, the buffers the kernel touches, the control block —
  a Runtime epoch, and ``finish_from_log(log_dir)`` completes the launch in a fresh process.

One armed launch per kernel at a time: the module global is per module, not per launch.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InstrumentError, UnsafeKernelError
from .safepoints import CTL_BITMAP, CTL_PAUSE, SYMBOL_PREFIX, ctl_bytes, decode_bitmap, pending_blocks

if TYPE_CHECKING:
    from .inductor import ControlView

Grid = tuple[int, int, int]


def _grid3(grid: int | Sequence[int]) -> Grid:
    g = [grid] if isinstance(grid, int) else list(grid)
    g = (g + [1, 1])[:3]
    if any(int(x) < 1 for x in g):
        raise InstrumentError(f"grid {tuple(g)} has an empty dimension")
    return int(g[0]), int(g[1]), int(g[2])


def _drv() -> Any:
    from ..cuda.driver import bindings, ensure_context

    ensure_context()
    return bindings()


def _check(res: Any, what: str) -> Any:
    from ..cuda.driver import check

    return check(res, what)


@dataclass(frozen=True)
class PauseStats:
    request_to_drained_s: float  # flag written -> launch complete (host clock)
    pending_blocks: int
    done_blocks: int


class PausableLaunch:
    """One launch of an instrumented Triton kernel that can be paused by blocks and resumed."""

    def __init__(self, fn: Any, grid: int | Sequence[int], args: Sequence[Any],
                 kwargs: dict[str, Any] | None = None, *, ctl: Any = None) -> None:
        import torch

        self.fn = fn
        self.grid = _grid3(grid)
        self.args = list(args)
        self.kwargs = dict(kwargs or {})
        self.kernel = fn.warmup(*self.args, grid=self.grid, **self.kwargs)
        self.kernel._init_handles()
        self.name = self.kernel.name
        ptx = self.kernel.asm.get("ptx", "")
        self.symbol = SYMBOL_PREFIX + self.name
        if self.symbol not in ptx:
            raise UnsafeKernelError(self.name, "not_instrumented",
                                    "it was compiled without safe points (call triton_hook.install() before its "
                                    "first compile) or the rewriter refused it")
        self.nblocks = self.grid[0] * self.grid[1] * self.grid[2]
        dev = next((a.device for a in self.args if isinstance(a, torch.Tensor)), torch.device("cuda"))
        self.ctl = ctl if ctl is not None else torch.zeros(ctl_bytes(self.nblocks) // 4, dtype=torch.int32,
                                                           device=dev)
        self._side: Any = None
        self._done: Any = None
        self._one: Any = None
        self._global = self._module_global()
        self.arm()

    # ------------------------------------------------------------------ driver plumbing
    def _module_global(self) -> int:
        drv = _drv()
        ptr, size = _check(drv.cuModuleGetGlobal(int(self.kernel.module), self.symbol.encode()),
                           f"cuModuleGetGlobal({self.symbol})")
        if int(size) != 8:
            raise InstrumentError(f"{self.symbol} is {int(size)} bytes, expected 8")
        return int(ptr)

    def arm(self, on: bool = True) -> None:
        """Point the kernel's module global at this launch's control block (0 disarms the probes)."""
        import numpy as np

        drv = _drv()
        value = np.array([self.ctl.data_ptr() if on else 0], dtype=np.uint64)
        _check(drv.cuMemcpyHtoD(self._global, value.ctypes.data, 8), f"write {self.symbol}")

    def disarm(self) -> None:
        self.arm(False)

    # ------------------------------------------------------------------ protocol
    def _launch(self) -> None:
        import torch

        self.fn[self.grid](*self.args, **self.kwargs)
        self._done = torch.cuda.Event()
        self._done.record()

    def start(self) -> None:
        self.ctl.zero_()
        self._launch()

    def request_pause(self) -> float:
        """Ask the running launch to pause; returns the host time of the request (perf_counter)."""
        from ..cuda.driver import Stream

        drv = _drv()
        if self._side is None:
            self._side = Stream.create(non_blocking=True)
        t = time.perf_counter()
        res = drv.cuStreamWriteValue32(self._side.handle, self.ctl.data_ptr() + CTL_PAUSE, 1, 0)
        if int(res[0]) != 0:  # no stream memory ops here: a copy-engine write from pinned memory lands as well
            import torch

            if self._one is None:
                self._one = torch.ones(1, dtype=torch.int32).pin_memory()
            _check(drv.cuMemcpyHtoDAsync(self.ctl.data_ptr() + CTL_PAUSE, self._one.data_ptr(), 4,
                                         self._side.handle), "cuMemcpyHtoDAsync(pause)")
        return t

    def drain(self) -> None:
        if self._done is not None:
            self._done.synchronize()
        if self._side is not None:
            self._side.synchronize()

    def pause(self) -> PauseStats:
        t0 = self.request_pause()
        self.drain()
        dt = time.perf_counter() - t0
        pend = len(self.pending())
        return PauseStats(dt, pend, self.nblocks - pend)

    def done(self) -> list[int]:
        """Block indexes that ran to completion (``(z * ny + y) * nx + x``)."""
        self.drain()
        return decode_bitmap(self.ctl[CTL_BITMAP // 4:].cpu().tolist(), self.nblocks)

    def pending(self) -> list[int]:
        """Block indexes that still have to run."""
        self.drain()
        return pending_blocks(self.ctl[CTL_BITMAP // 4:].cpu().tolist(), self.nblocks)

    def resume(self) -> None:
        """Relaunch the full grid; only the pending blocks run."""
        self.drain()
        self.ctl[CTL_PAUSE // 4].zero_()
        self._launch()

    # ------------------------------------------------------------------ epochs
    def checkpoint(self, rt: Any, *, prefix: str = "paused") -> int:
        """Commit the paused launch (its tensor arguments, scalars, control block) as one Runtime epoch."""
        import torch

        if not self.pending():
            raise InstrumentError(f"launch of {self.name} has no pending blocks: nothing to checkpoint")
        torch.cuda.synchronize()
        return checkpoint_paused(rt, self.fn, self.grid, self.args, self.kwargs, self.ctl, prefix=prefix)


def checkpoint_paused(rt: Any, fn: Any, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any],
                      ctl: Any, *, prefix: str = "paused") -> int:
    """Commit a paused launch as one epoch: every tensor argument (host copies), the scalars, the control
    block, and what is needed to relaunch it (the kernel's import path, grid, constexprs)."""
    import torch

    spec: list[Any] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            rt.register(f"{prefix}.arg{i}", a.detach().contiguous().cpu(), kind="dense")
            spec.append({"tensor": f"{prefix}.arg{i}", "dtype": str(a.dtype), "shape": list(a.shape)})
        else:
            spec.append({"scalar": a})
    rt.register(f"{prefix}.ctl", ctl.detach().contiguous().cpu(), kind="dense")
    g = _grid3(grid)
    pending = len(pending_blocks(ctl[CTL_BITMAP // 4:].cpu().tolist(), g[0] * g[1] * g[2]))
    py = getattr(fn, "fn", fn)  # JITFunction / InterpretedFunction -> the Python function
    meta = {"paused_launch": {"fn": f"{py.__module__}:{py.__qualname__}", "grid": list(g), "args": spec,
                              "kwargs": dict(kwargs), "ctl": f"{prefix}.ctl", "kernel": py.__name__,
                              "pending": pending}}
    return int(rt.checkpoint(meta=meta))


def _import_fn(ref: str) -> Any:
    mod, _, qual = ref.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def finish_from_log(log_dir: str | Path, *, device: str = "cuda") -> dict[str, Any]:
    """In a fresh process: recover a paused launch from its epoch, run its pending blocks, and return its
    tensor arguments by region name (outputs included), on ``device``.

    ``device="cpu"`` runs the pending blocks in Triton's interpreter (``TRITON_INTERPRET=1`` must be set
    before the kernel's module is imported): no GPU needed, numpy's arithmetic for those blocks."""
    from ..runtime import recover

    rec = recover(log_dir)
    meta = (rec.meta or {}).get("paused_launch")
    if meta is None:
        raise InstrumentError(f"the last epoch of {log_dir} holds no paused launch")
    args: list[Any] = []
    tensors: dict[str, Any] = {}
    for a in meta["args"]:
        if "tensor" in a:
            t = rec.tensor(a["tensor"], device=device)
            tensors[a["tensor"]] = t
            args.append(t)
        else:
            args.append(a["scalar"])
    ctl = rec.tensor(meta["ctl"], device=device)
    fn = _import_fn(meta["fn"])
    grid = _grid3(meta["grid"])
    nblocks = grid[0] * grid[1] * grid[2]
    pend = pending_blocks(ctl[CTL_BITMAP // 4:].tolist(), nblocks)
    if len(pend) != meta["pending"]:
        raise InstrumentError(f"recovered bitmap has {len(pend)} pending blocks, the epoch said {meta['pending']}")
    if device == "cpu":
        from .interpret import run_blocks

        run_blocks(fn, grid, args, meta["kwargs"], pend)
        return tensors
    launch = PausableLaunch(fn, grid, args, meta["kwargs"], ctl=ctl)
    launch.resume()
    launch.drain()
    if launch.pending():
        raise InstrumentError(f"{len(launch.pending())} blocks still pending after the resume launch")
    return tensors


# ---------------------------------------------------------------------- a pause set by the GPU, at a block count
TRIGGER_SOURCE = r"""
static __device__ __forceinline__ unsigned long long cft_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* One block: count the done bits of a running launch's control block until at least `threshold` blocks
   finished, then write its pause word. out: [done count seen, globaltimer at the write, 1 = reached the count
   / 2 = timed out, globaltimer at start]. */
extern "C" __global__ void cft_pause_after_blocks(const unsigned int *bitmap, unsigned int nwords,
                                                  unsigned int threshold, unsigned int *pause_word,
                                                  unsigned long long timeout_ns, unsigned long long *out) {
  __shared__ unsigned int total;
  __shared__ int stop;
  unsigned long long t0 = cft_now();
  const volatile unsigned int *bits = bitmap;
  for (;;) {
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    unsigned int c = 0;
    for (unsigned int w = threadIdx.x; w < nwords; w += blockDim.x) c += __popc(bits[w]);
    atomicAdd(&total, c);
    __syncthreads();
    if (threadIdx.x == 0) stop = total >= threshold ? 1 : (cft_now() - t0 > timeout_ns ? 2 : 0);
    __syncthreads();
    if (stop) break;
  }
  if (threadIdx.x == 0) {
    atomicExch(pause_word, 1u);
    __threadfence_system();
    out[0] = total;
    out[1] = cft_now();
    out[2] = (unsigned long long)stop;
    out[3] = t0;
  }
}
"""


class GpuPauseTrigger:
    """Pauses a running ``PausableLaunch`` from the GPU at a definite point: a one-block kernel on its own
    stream reads the launch's done bits while it runs and writes the pause word once at least ``after_blocks``
    blocks have finished. The blocks running then finish, the blocks not yet started leave at entry: the pause
    lands mid-grid by construction, not by a host timer (a host write takes ~50-100 us to arrive, longer than
    many kernels). ``timeout_s`` bounds the spin if the count is never reached (the launch was not armed)."""

    def __init__(self, device: int | None = None) -> None:
        from ..cuda import nvrtc

        self._mod = nvrtc.load_module(TRIGGER_SOURCE, "cft_pause_trigger", device=device)
        self._fn = self._mod.function("cft_pause_after_blocks")
        self._out: Any = None

    def arm(self, launch: PausableLaunch | ControlView, after_blocks: int, stream: Any, *,
            timeout_s: float = 1.0) -> None:
        """``launch``: a ``PausableLaunch``, or one launch of an Inductor-compiled function
        (``inductor.ArmedLaunches.view(i)``). Enqueue the trigger on ``stream`` (a ``cuda.driver.Stream``; not the launch's stream, which it must
        run beside). Call after the launch's control block was zeroed on its stream and ``stream`` waits for
        that, and before the launch itself."""
        import ctypes

        import torch

        from ..cuda import driver

        if not 0 < after_blocks <= launch.nblocks:
            raise InstrumentError(f"after_blocks {after_blocks}: the launch has {launch.nblocks} blocks")
        if self._out is None:
            self._out = torch.zeros(4, dtype=torch.int64, device=launch.ctl.device)
        nwords = (launch.nblocks + 31) // 32
        args = driver.KernelArgs([(ctypes.c_uint64, launch.ctl.data_ptr() + CTL_BITMAP),
                                  (ctypes.c_uint32, nwords), (ctypes.c_uint32, after_blocks),
                                  (ctypes.c_uint64, launch.ctl.data_ptr() + CTL_PAUSE),
                                  (ctypes.c_uint64, int(timeout_s * 1e9)), (ctypes.c_uint64, self._out.data_ptr())])
        self._args = args  # alive until the launch has read them (the driver copies them at launch)
        driver.launch(self._fn, 1, 256, args, stream, what="cft_pause_after_blocks")

    def result(self) -> dict[str, int]:
        """After the trigger ran: done blocks it saw when it wrote the pause word, the write's globaltimer (ns),
        and whether it reached the count (else it timed out and paused anyway)."""
        seen, t_write, how, t0 = (int(v) for v in self._out.cpu().tolist())
        return {"done_seen": seen, "t_write_ns": t_write, "reached": int(how == 1), "spin_ns": t_write - t0}
