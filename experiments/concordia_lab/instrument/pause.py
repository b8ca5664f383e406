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

Protocol 5 (the default, "record on pause"): the control block is an arena aligned to a power of two whose
64-byte header holds the pause and mode words, followed by one record ``(s, rem)`` per block; a block that sees
the pause at its vote adds one to its ``s`` and leaves, so after the drain *pending = blocks with s > 0*, and
``resume()`` sets the mode to resume and each ``rem`` to 1 (the launch's place from the end of a one-launch
sequence). Protocol 4 (done bits) is kept for comparison: which one a kernel carries is read from its PTX.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InstrumentError, UnsafeKernelError
from .safepoints import (
    CTL_BITMAP,
    CTL_PAUSE,
    HARG_PREFIX,
    HDR_BYTES,
    HDR_MODE,
    HDR_PAUSE,
    MODE_RESUME,
    PROTO_PREFIX,
    SYMBOL_PREFIX,
    ctl_bytes,
    decode_bitmap,
    pending_blocks,
    v5_align_log2,
    v5_ctl_value,
    v5_region_bytes,
)

if TYPE_CHECKING:
    from .inductor import ControlView

Grid = tuple[int, int, int]


def _grid3(grid: int | Sequence[int]) -> Grid:
    g = [grid] if isinstance(grid, int) else list(grid)
    g = (g + [1, 1])[:3]
    if any(int(x) < 1 for x in g):
        raise InstrumentError(f"grid {tuple(g)} has an empty dimension")
    return int(g[0]), int(g[1]), int(g[2])


def aligned_arena(nbytes: int, device: Any) -> tuple[Any, Any, int]:
    """An int32 tensor of ``nbytes`` whose address is aligned to ``2**A >= nbytes`` (protocol 5: the probes
    find the header by masking the address): ``(arena view, backing tensor, A)``."""
    import torch

    a = v5_align_log2(nbytes)
    backing = torch.zeros((2 << a) // 4, dtype=torch.int32, device=device)
    base = backing.data_ptr()
    off = (-base) % (1 << a)
    arena = backing[off // 4: off // 4 + nbytes // 4]
    return arena, backing, a


def _drv() -> Any:
    from concordia_ft.cuda.driver import bindings, ensure_context

    ensure_context()
    return bindings()


def _check(res: Any, what: str) -> Any:
    from concordia_ft.cuda.driver import check

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
        self.protocol = 5 if f"{PROTO_PREFIX}{self.name}" in ptx else 4
        self.header_arg = f"{HARG_PREFIX}{self.name}" in ptx  # its header comes in a kernel parameter
        dev = next((a.device for a in self.args if isinstance(a, torch.Tensor)), torch.device("cuda"))
        self._backing: Any = None
        if self.protocol == 5:
            # the arena: header (pause, mode), then one (s, rem) record per block
            self.ctl, self._backing, self._align = aligned_arena(HDR_BYTES + v5_region_bytes(self.nblocks), dev)
            self.records = self.ctl[HDR_BYTES // 4: HDR_BYTES // 4 + 2 * self.nblocks].view(self.nblocks, 2)
            if ctl is not None:  # recovered records (finish_from_log)
                self.records.copy_(ctl.reshape(self.nblocks, 2).to(self.ctl.device))
        else:
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
        ptr = self.ctl.data_ptr() if self.protocol == 4 else \
            v5_ctl_value(self.ctl.data_ptr() + HDR_BYTES, self._align)
        value = np.array([ptr if on else 0], dtype=np.uint64)
        _check(drv.cuMemcpyHtoD(self._global, value.ctypes.data, 8), f"write {self.symbol}")

    @property
    def pause_ptr(self) -> int:
        """Device address of the pause word (the header's, protocol 5)."""
        return int(self.ctl.data_ptr()) + (HDR_PAUSE if self.protocol == 5 else CTL_PAUSE)

    def disarm(self) -> None:
        self.arm(False)

    # ------------------------------------------------------------------ protocol
    def _launch(self) -> None:
        import torch

        if self.header_arg:  # the launcher asks header_arg's allocator for the parameter: this launch's header
            from . import header_arg

            route = int(self.kernel.metadata.profile_scratch_align)
            with header_arg.using(self.ctl.data_ptr(), self._backing, route):
                self.fn[self.grid](*self.args, **self.kwargs)
        else:
            self.fn[self.grid](*self.args, **self.kwargs)
        self._done = torch.cuda.Event()
        self._done.record()

    def start(self) -> None:
        self.ctl.zero_()
        self._launch()

    def request_pause(self) -> float:
        """Ask the running launch to pause; returns the host time of the request (perf_counter)."""
        from concordia_ft.cuda.driver import Stream

        drv = _drv()
        if self._side is None:
            self._side = Stream.create(non_blocking=True)
        t = time.perf_counter()
        res = drv.cuStreamWriteValue32(self._side.handle, self.pause_ptr, 1, 0)
        if int(res[0]) != 0:  # no stream memory ops here: a copy-engine write from pinned memory lands as well
            import torch

            if self._one is None:
                self._one = torch.ones(1, dtype=torch.int32).pin_memory()
            _check(drv.cuMemcpyHtoDAsync(self.pause_ptr, self._one.data_ptr(), 4,
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
        if self.protocol == 5:
            pend = set(self.pending())
            return [b for b in range(self.nblocks) if b not in pend]
        return decode_bitmap(self.ctl[CTL_BITMAP // 4:].cpu().tolist(), self.nblocks)

    def pending(self) -> list[int]:
        """Block indexes that still have to run."""
        self.drain()
        if self.protocol == 5:  # a block skipped (s > 0) this one-launch sequence's only launch
            return [int(b) for b in self.records[:, 0].nonzero().flatten().cpu().tolist()]
        return pending_blocks(self.ctl[CTL_BITMAP // 4:].cpu().tolist(), self.nblocks)

    def resume(self) -> None:
        """Relaunch the full grid; only the pending blocks run."""
        self.drain()
        if self.protocol == 5:
            self.ctl[HDR_PAUSE // 4].zero_()
            self.ctl[HDR_MODE // 4].fill_(MODE_RESUME)
            self.records[:, 1].fill_(1)  # each block's place from the end of a one-launch sequence
        else:
            self.ctl[CTL_PAUSE // 4].zero_()
        self._launch()

    def state(self) -> Any:
        """The paused state that an epoch keeps: protocol 4 the control block (pause word + done bits),
        protocol 5 the per-block records (``s``: launches skipped, the block bitmap in effect)."""
        return self.records if self.protocol == 5 else self.ctl

    # ------------------------------------------------------------------ epochs
    def checkpoint(self, rt: Any, *, prefix: str = "paused") -> int:
        """Commit the paused launch (its tensor arguments, scalars, control block) as one Runtime epoch."""
        import torch

        if not self.pending():
            raise InstrumentError(f"launch of {self.name} has no pending blocks: nothing to checkpoint")
        torch.cuda.synchronize()
        return checkpoint_paused(rt, self.fn, self.grid, self.args, self.kwargs, self.state(), prefix=prefix,
                                 protocol=self.protocol)


def _pending_of(state: Any, nblocks: int, protocol: int) -> list[int]:
    if protocol == 5:
        s = state.reshape(-1, 2)[:, 0].tolist()
        return [b for b in range(nblocks) if int(s[b]) > 0]
    return pending_blocks(state.reshape(-1)[CTL_BITMAP // 4:].tolist(), nblocks)


def checkpoint_paused(rt: Any, fn: Any, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any],
                      ctl: Any, *, prefix: str = "paused", protocol: int = 4) -> int:
    """Commit a paused launch as one epoch: every tensor argument (host copies), the scalars, the paused state
    (``ctl``: protocol 4 the control block with its done bits, protocol 5 the per-block skip records), and
    what is needed to relaunch it (the kernel's import path, grid, constexprs)."""
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
    pending = len(_pending_of(ctl.detach().cpu(), g[0] * g[1] * g[2], protocol))
    py = getattr(fn, "fn", fn)  # JITFunction / InterpretedFunction -> the Python function
    meta = {"paused_launch": {"fn": f"{py.__module__}:{py.__qualname__}", "grid": list(g), "args": spec,
                              "kwargs": dict(kwargs), "ctl": f"{prefix}.ctl", "kernel": py.__name__,
                              "pending": pending, "protocol": protocol}}
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
    from concordia_ft.runtime import recover

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
    protocol = int(meta.get("protocol", 4))
    pend = _pending_of(ctl.cpu(), nblocks, protocol)
    if len(pend) != meta["pending"]:
        raise InstrumentError(f"recovered bitmap has {len(pend)} pending blocks, the epoch said {meta['pending']}")
    if device == "cpu":
        from .interpret import run_blocks

        run_blocks(fn, grid, args, meta["kwargs"], pend)
        return tensors
    launch = PausableLaunch(fn, grid, args, meta["kwargs"], ctl=ctl)
    if launch.protocol != protocol:
        raise InstrumentError(f"the epoch holds a protocol-{protocol} paused launch, but {launch.name} compiled "
                              f"here carries protocol {launch.protocol}: install the hook with "
                              f"SafepointOptions(protocol={protocol})")
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
                                                  unsigned long long timeout_ns, unsigned long long *out,
                                                  unsigned int *started, unsigned int gen) {
  __shared__ unsigned int total;
  __shared__ int stop;
  unsigned long long t0 = cft_now();
  if (threadIdx.x == 0) { atomicExch(started, gen); __threadfence_system(); }  /* releases the gated stream */
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

/* Protocol 5 has no done bits: count sampled words of a watched output buffer that no longer hold
   `sentinel` (word k*stride for k < n: the first word block k*step writes) until at least `threshold` of them
   changed, then write the pause word. A block that wrote its first word had passed its vote. out: as above. */
extern "C" __global__ void cft_pause_after_writes(const unsigned int *buf, unsigned int n,
                                                  unsigned long long stride, unsigned int sentinel,
                                                  unsigned int threshold, unsigned int *pause_word,
                                                  unsigned long long timeout_ns, unsigned long long *out,
                                                  unsigned int *started, unsigned int gen) {
  __shared__ unsigned int total;
  __shared__ int stop;
  unsigned long long t0 = cft_now();
  if (threadIdx.x == 0) { atomicExch(started, gen); __threadfence_system(); }  /* releases the gated stream */
  const volatile unsigned int *w = buf;
  for (;;) {
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    unsigned int c = 0;
    for (unsigned int k = threadIdx.x; k < n; k += blockDim.x) c += (w[k * stride] != sentinel);
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
    many kernels). ``timeout_s`` bounds the spin if the count is never reached (the launch was not armed).

    The launch's stream is gated on the trigger: ``arm`` enqueues a stream wait there (``cuStreamWaitValue32``)
    that the trigger releases once it runs, so the watched kernel cannot fill the GPU first and leave the
    trigger's block waiting for an SM until most of its grid was dispatched (ungated, a pause meant for 3/4 of a
    262,144-block softmax landed after the grid drained). The trigger block has one thread per sample (1024 by
    default), so a scan is one memory round trip: with 128 threads (8 samples each) the pause meant for the
    middle of a 35 us layer landed after it (instrument/DESIGN.md, "Pausing from the GPU")."""

    def __init__(self, device: int | None = None) -> None:
        from concordia_ft.cuda import nvrtc

        self._mod = nvrtc.load_module(TRIGGER_SOURCE, "cft_pause_trigger", device=device)
        self._fn = self._mod.function("cft_pause_after_blocks")
        self._fn_writes = self._mod.function("cft_pause_after_writes")
        self._out: Any = None
        self._gen = 0
        self.step = 1

    def arm(self, launch: PausableLaunch | ControlView, after_blocks: int, stream: Any, *,
            watch: Any = None, words_per_block: int = 0, sentinel: int = 0x7FC00000,
            max_samples: int = 1024, timeout_s: float = 1.0, gate: Any = "current", threads: int = 1024) -> None:
        """``launch``: a ``PausableLaunch``, or one launch of an Inductor-compiled function
        (``inductor.ArmedLaunches.view(i)``). Enqueue the trigger on ``stream`` (a ``cuda.driver.Stream``; not the launch's stream, which it must
        run beside). Call after the launch's control block was zeroed on its stream and ``stream`` waits for
        that, and before the launch itself. ``gate``: the stream the launch will run on (a torch stream, a raw
        stream handle, or "current": torch's current stream), which waits until the trigger runs; None: no
        gate (the trigger may start late). ``threads``: the protocol-5 trigger block's size (32..1024)."""
        import ctypes

        import torch

        from concordia_ft.cuda import driver

        if not 0 < after_blocks <= launch.nblocks:
            raise InstrumentError(f"after_blocks {after_blocks}: the launch has {launch.nblocks} blocks")
        if not 32 <= threads <= 1024 or threads % 32:
            raise InstrumentError(f"threads={threads}: a multiple of 32 from 32 to 1024")
        if self._out is None:
            self._out = torch.zeros(5, dtype=torch.int64, device=launch.ctl.device)  # [4]: the started word
        self._gen = gen = (self._gen % 0x7FFFFFFF) + 1
        started = self._out.data_ptr() + 32
        gate_handle: int | None = None
        if gate is not None:
            gs: Any = torch.cuda.current_stream(launch.ctl.device) if isinstance(gate, str) and gate == "current" \
                else gate
            gate_handle = int(gs.cuda_stream if hasattr(gs, "cuda_stream") else gs)
            if int(getattr(stream, "handle", -1)) == gate_handle:
                raise InstrumentError("the trigger's stream is the launch's: run the trigger on a stream of its "
                                      "own (it must run beside the launch)")
        tail = [(ctypes.c_uint64, started), (ctypes.c_uint32, gen)]
        if getattr(launch, "protocol", 4) == 5 or watch is not None:
            # no done bits (protocol 5): watch the first word each block writes, every step-th block (at most
            # max_samples words, one per thread of the trigger: a scan costs about one memory round trip, so the
            # pause lands close to the count; sampling 32768 words, it landed too late)
            if watch is None or words_per_block < 1:
                raise InstrumentError("a protocol-5 launch has no done bits to count: pass watch= (the output "
                                      "tensor, filled with `sentinel` before the launch) and words_per_block= "
                                      "(32-bit words between the first words two neighbouring blocks write)")
            if watch.numel() * watch.element_size() < 4 * launch.nblocks * words_per_block:
                raise InstrumentError(f"watch holds {watch.numel() * watch.element_size()} bytes, fewer than "
                                      f"{launch.nblocks} blocks x {words_per_block} words")
            self.step = step = -(-launch.nblocks // max_samples)
            n = -(-launch.nblocks // step)
            wargs = driver.KernelArgs([(ctypes.c_uint64, watch.data_ptr()), (ctypes.c_uint32, n),
                                       (ctypes.c_uint64, step * words_per_block), (ctypes.c_uint32, sentinel),
                                       (ctypes.c_uint32, -(-after_blocks // step)),
                                       (ctypes.c_uint64, launch.pause_ptr), (ctypes.c_uint64, int(timeout_s * 1e9)),
                                       (ctypes.c_uint64, self._out.data_ptr()), *tail])
            self._args = wargs
            driver.launch(self._fn_writes, 1, threads, wargs, stream, what="cft_pause_after_writes")
            self._gate(gate_handle, started, gen)
            return
        self.step = 1
        nwords = (launch.nblocks + 31) // 32
        args = driver.KernelArgs([(ctypes.c_uint64, launch.ctl.data_ptr() + CTL_BITMAP),
                                  (ctypes.c_uint32, nwords), (ctypes.c_uint32, after_blocks),
                                  (ctypes.c_uint64, launch.pause_ptr),
                                  (ctypes.c_uint64, int(timeout_s * 1e9)), (ctypes.c_uint64, self._out.data_ptr()),
                                  *tail])
        self._args = args  # alive until the launch has read them (the driver copies them at launch)
        driver.launch(self._fn, 1, 256, args, stream, what="cft_pause_after_blocks")
        self._gate(gate_handle, started, gen)

    @staticmethod
    def _gate(handle: int | None, started: int, gen: int) -> None:
        """The launch's stream waits until the trigger wrote ``gen`` into its started word (it is running)."""
        if handle is None:
            return
        drv = _drv()
        _check(drv.cuStreamWaitValue32(handle, started, gen, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ),
               "cuStreamWaitValue32 (the launch's stream waits for the pause trigger to start)")

    def result(self) -> dict[str, int]:
        """After the trigger ran: done blocks it saw when it wrote the pause word, the write's globaltimer (ns),
        and whether it reached the count (else it timed out and paused anyway)."""
        seen, t_write, how, t0, _started = (int(v) for v in self._out.cpu().tolist())
        return {"done_seen": seen * self.step, "sample_step": self.step, "t_write_ns": t_write, "reached": int(how == 1), "spin_ns": t_write - t0}
