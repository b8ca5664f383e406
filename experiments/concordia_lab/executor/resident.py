"""Executors: one interface over three ways of running built-in device work.

- :class:`ResidentExecutor`: one persistent block on a non-blocking stream consumes the ring of
  ``executor/ring.py`` in host-mapped memory. A task costs a host store, no launch. It exits by itself after an
  idle timeout or a lease (so a hazard it misses is a bounded stall, never a hang) and is relaunched on the
  next submit; ``suspend()``/``resume()`` for the hazard guard; ``swap()`` hands the ring to a newly built
  image (the old one exits at a task boundary, the new one resumes from the ring's tail).
- :class:`ArmedChannel`: full-width launches enqueued ahead of time (stream wait on a flag -> the wide
  dispatcher -> stream write of a done word). Fired by a host store, or by the resident executor itself
  (a ``TRIGGER`` task), so the GPU starts full-width work with no host launch.
- :class:`LaunchExecutor`: a plain launch of the wide dispatcher per task.

All three run the same opcodes (``executor.ring.Opcode``) from one module built from ``resident.cuh``.
:func:`choose_path` picks one per region kind and size from measurements (experiments/bench_executor.py).
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any, NoReturn, Protocol

from concordia_ft.core.regions import RegionKind
from concordia_ft.cuda import driver, nvrtc
from concordia_ft.cuda.memory import DeviceBuffer, PinnedBuffer

from ..errors import ConfigError, ExecutorError, ExecutorTimeout, RingFullError
from . import ring as R

BATCH = 4  # descriptors a warp fetches per poll (32 lanes x 8 bytes = 4 slots)
HEARTBEAT_NS = 100_000
DEFAULT_THREADS = 256  # the wide dispatcher's block size
RESIDENT_THREADS = 256  # the resident block (T9: a 1-warp 32-register block cost more matmul, not less)
RESIDENT_MAX_REGS = 0  # 0: __launch_bounds__(threads); > 0: __maxnreg__ cap
_U32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------- source


def render_executor_source(image_id: int = 1, threads: int = RESIDENT_THREADS,
                           max_regs: int = RESIDENT_MAX_REGS) -> str:
    """resident.cuh with the ring layout, opcodes and states of executor/ring.py rendered in front of it."""
    if not 32 <= threads <= 1024 or threads % 32:
        raise ConfigError(f"executor threads must be a multiple of 32 in [32, 1024], got {threads}")
    if not 0 < image_id < 1 << 31:
        raise ConfigError(f"image_id must be in [1, 2**31), got {image_id}")
    d: dict[str, int] = {"CCR_IMAGE_ID": image_id, "CCR_THREADS": threads, "CCR_BATCH": BATCH,
                         "CCR_HEARTBEAT_NS": HEARTBEAT_NS, "CCR_SLOTS_OFF": R.CTRL_BYTES,
                         "CCR_SLOT_BYTES": R.SLOT_BYTES, "CCR_RESULT_BYTES": R.RESULT_BYTES,
                         "CCR_MAX_RELEASES": R.MAX_RELEASES, "CCR_MAX_REGS": max_regs,
                         "CCR_MAGIC": R.MAGIC, "CCR_VERSION": R.VERSION, "CCR_TAG_SHIFT": R.TAG_SHIFT,
                         "CCR_TAG_MARK": R.TAG_MARK, "CCR_TAG_SEQ_MASK": R.TAG_SEQ_MASK}
    for name in ("MAGIC", "VERSION", "CAPACITY", "STOP", "TAIL", "HEARTBEAT", "STATE", "IMAGE", "ERROR",
                 "ERROR_SEQ", "STARTS", "RELEASE_COUNT", "RELEASES"):
        d[f"CCR_OFF_{name}"] = getattr(R, f"OFF_{name}")
    d.update({f"CCR_OP_{op.name}": int(op) for op in R.Opcode})
    d.update({f"CCR_STATE_{s.name}": int(s) for s in R.ConsumerState})
    d.update({f"CCR_STATUS_{s.name}": int(s) for s in R.Status})
    d.update({f"CCR_ERR_{e.name}": int(e) for e in R.ConsumerError})
    header = "\n".join(f"#define {k} {v}u" if k.startswith(("CCR_OFF", "CCR_MAGIC", "CCR_TAG")) else
                       f"#define {k} {v}" for k, v in d.items())
    body = resources.files(__package__).joinpath("resident.cuh").read_text()
    return f"// rendered by concordia_lab.executor.resident (image {image_id})\n{header}\n\n{body}"


def compile_executor(image_id: int = 1, threads: int = RESIDENT_THREADS, arch: str = nvrtc.DEFAULT_ARCH,
                     use_cache: bool = True, max_regs: int = RESIDENT_MAX_REGS) -> nvrtc.CompiledModule:
    """NVRTC-compile an executor image to a cubin (no GPU needed)."""
    return nvrtc.compile_cubin(render_executor_source(image_id, threads, max_regs), f"concordia_executor_v{image_id}",
                               nvrtc.CompileOptions(arch=arch), use_cache=use_cache)


class ExecutorImage:
    """A loaded executor module. Loading blocks while any kernel is resident: build under guard.quiesced()."""

    def __init__(self, image_id: int = 1, threads: int = RESIDENT_THREADS, device: int | None = None,
                 compiled: nvrtc.CompiledModule | None = None) -> None:
        self.device = driver.ensure_context(device)
        self.image_id = image_id
        self.threads = threads
        self.compiled = compiled or compile_executor(image_id, threads, driver.arch_of(self.device))
        self.module = nvrtc.Module(self.compiled, self.device)
        self.resident = self.module.function("concordia_executor")
        self.wide = self.module.function("concordia_exec_wide")
        self.wide_at = self.module.function("concordia_exec_wide_at")

    def attribute(self, function: Any, name: str) -> int:
        drv = driver.bindings()
        attr = getattr(drv.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
        return int(driver.check(drv.cuFuncGetAttribute(attr, function), f"cuFuncGetAttribute({name})"))

    def set_attribute(self, function: Any, name: str, value: int) -> None:
        drv = driver.bindings()
        attr = getattr(drv.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
        driver.check(drv.cuFuncSetAttribute(function, attr, value), f"cuFuncSetAttribute({name}={value})")

    def close(self) -> None:
        self.module.close()


# ---------------------------------------------------------------------------------------------- helpers


def _stream_wait(stream: driver.Stream, addr: int, value: int) -> None:
    drv = driver.bindings()
    driver.check(drv.cuStreamWaitValue32(drv.CUstream(stream.handle), drv.CUdeviceptr(addr), value & _U32,
                                         drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                 "cuStreamWaitValue32")


def _stream_write(stream: driver.Stream, addr: int, value: int) -> None:
    drv = driver.bindings()
    driver.check(drv.cuStreamWriteValue32(drv.CUstream(stream.handle), drv.CUdeviceptr(addr), value & _U32,
                                          drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
                 "cuStreamWriteValue32")


def cyclic_reached(word: int, target: int) -> bool:
    """The stream-wait comparison (GEQ is cyclic: (int32)(word - target) >= 0)."""
    return ((word - target) & _U32) < 0x80000000


def wide_grid(sms: int, opcode: int, n: int, threads: int = DEFAULT_THREADS) -> int:
    """Blocks for a full-width task: enough to cover the work, at most 4 per SM."""
    if opcode in (R.Opcode.PAGE_DIFF, R.Opcode.RESTORE):
        need = math.ceil(n / max(1, threads // 32))
    elif opcode in (R.Opcode.NOP, R.Opcode.MARK, R.Opcode.TRIGGER, R.Opcode.SLEEP):
        need = 1
    else:
        need = math.ceil(n / (threads * 16))  # four float4 per thread per pass
    return max(1, min(4 * sms, need))


class Executor(Protocol):
    """What every path offers: submit a task (opcode + up to 6 args + aux), wait for it, get out of the way."""

    kind: str

    def submit(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
               a5: int = 0, aux: int = 0) -> int: ...

    def wait(self, ticket: int, timeout_s: float = 10.0) -> int: ...

    def suspend(self) -> None: ...

    def resume(self, eager: bool = True) -> None: ...

    def close(self) -> None: ...


def run_task(ex: Executor, opcode: int, *args: int, aux: int = 0, timeout_s: float = 10.0) -> int:
    a = tuple(args) + (0,) * (R.MAX_ARGS - len(args))
    return ex.wait(ex.submit(opcode, a[0], a[1], a[2], a[3], a[4], a[5], aux), timeout_s)


# ---------------------------------------------------------------------------------------------- resident


@dataclass(frozen=True)
class ExecutorOptions:
    capacity: int = 1024
    threads: int = RESIDENT_THREADS  # the resident block; the wide kernels always run DEFAULT_THREADS
    # exit after this long without a task (the next submit relaunches it). Short on purpose: while resident the
    # block holds one SM, and cuBLAS's persistent GEMMs (grid = 132 CTAs in 2-CTA clusters) lose 0-24 % to that
    # (experiments/results/resident_cost-h200.json); exiting 1 ms after a burst of tasks keeps GEMM phases whole
    # (experiments/results/sm_share-h200.json, duty-cycle rows) at the price of one relaunch for the first task after a quiet spell.
    idle_timeout_ms: float = 1.0
    lease_ms: float = 1000.0  # exit at a task boundary after this long resident, busy or not
    poll_sleep_ns: int = 0  # __nanosleep between polls (0: spin)
    image_id: int = 1
    # the ring's host fast paths: None = C when built (executor/_ringfast.c), True = require C, False = pure Python
    fast_ring: bool | None = None


class ResidentExecutor:
    """One resident block consuming the ring. Thread-safe submit/wait.

    ``submit`` and ``wait`` are the ring's host fast paths (:func:`executor.ring.make_submit` / ``make_wait``: the C
    extension ``executor/_ringfast.c`` when built, else Python closures; ``ExecutorOptions.fast_ring`` picks): one
    publish of the 8 tagged words, one word compare to see that the block runs; they fall back to
    :meth:`_submit_slow` / :meth:`_ensure_running` only when the ring is full or the block is not RUNNING.
    Producers in several threads: the C publish is one step under the GIL; the Python one serialises on a
    plain ``threading.Lock`` (held only around the slot write). Lifecycle changes (launch, suspend, swap, the
    exit-release table) serialise on a separate re-entrant lock, which the fast path never takes.
    """

    kind = "resident"
    submit: R.SubmitFn
    wait: R.WaitFn

    def __init__(self, options: ExecutorOptions | None = None, *, image: ExecutorImage | None = None,
                 device: int | None = None, start: bool = True) -> None:
        from . import guard

        self.options = o = options or ExecutorOptions()
        R.check_capacity(o.capacity)
        self.device = driver.ensure_context(device)
        self._lock = threading.RLock()  # lifecycle
        self._submit_lock = threading.Lock()  # producers (see the class docstring)
        self._launched = False
        self._suspended = False
        self._closed = False
        self._owns_image = image is None  # close() unloads only what this executor loaded
        self.launches = 0
        self._releases: dict[int, tuple[int, int]] = {}
        self._native: Any = None  # guard.NativeGuard, once registered there
        self._native_handle: int | None = None
        with guard.quiesced():  # loading a module blocks behind anything resident
            self.image = image or ExecutorImage(o.image_id, o.threads, self.device)
            self.mem = PinnedBuffer(R.ring_bytes(o.capacity))
            self.layout = R.RingLayout(self.mem.view(), o.capacity)
            self.layout.initialise()
            self._q = self.layout.q
            self._u32 = self.layout.u32
            self.producer = R.RingProducer(self.layout, fast=o.fast_ring)
            self.submit = R.make_submit(self.producer, self._submit_lock, self._submit_slow)
            self.wait = R.make_wait(self.producer, self._ensure_running, self._wait_timeout)
            self.stream = driver.Stream.create(non_blocking=True, device=self.device)
            self._scratch = PinnedBuffer(4096)
            self._scratch.view()[:] = bytes(4096)
            self._args = driver.KernelArgs([
                (ctypes.c_uint64, self.mem.device_ptr), (ctypes.c_uint32, o.capacity),
                (ctypes.c_uint64, int(o.idle_timeout_ms * 1e6)), (ctypes.c_uint64, int(o.lease_ms * 1e6)),
                (ctypes.c_uint32, o.poll_sleep_ns)])
            self.warm_up(self.image)
        guard.register(self)
        if start:
            self.resume()

    # -- state
    @property
    def state(self) -> R.ConsumerState:
        return R.ConsumerState(self._u32[R.OFF_STATE >> 2])

    @property
    def tail(self) -> int:
        return int(self._q[R.OFF_TAIL >> 3])

    @property
    def heartbeat(self) -> int:
        return int(self._q[R.OFF_HEARTBEAT >> 3])

    @property
    def image_id(self) -> int:
        return int(self._u32[R.OFF_IMAGE >> 2])

    @property
    def resident(self) -> bool:
        return self._launched and self.state in (R.ConsumerState.NOT_STARTED, R.ConsumerState.RUNNING)

    # -- lifecycle
    def warm_up(self, image: ExecutorImage) -> None:
        """Run every kernel path of ``image`` once with nothing resident (first launches load code)."""
        nop = self._scratch.device_ptr  # 64 zero bytes: a NOP descriptor
        self._request_stop(True)
        driver.launch(image.resident, 1, image.threads, self._args, self.stream, what="executor warm-up")
        self.stream.synchronize()
        self._request_stop(False)
        wide_args = driver.KernelArgs([(ctypes.c_uint64, 0)] * 8)
        driver.launch(image.wide, 1, DEFAULT_THREADS, wide_args, self.stream, what="wide warm-up")
        driver.launch(image.wide_at, 1, DEFAULT_THREADS,
                      driver.KernelArgs([(ctypes.c_uint64, nop), (ctypes.c_uint64, nop + 256)]), self.stream,
                      what="wide_at warm-up")
        _stream_write(self.stream, nop + 128, 1)
        _stream_wait(self.stream, nop + 128, 1)
        self.stream.synchronize()
        self._check_error()

    def _request_stop(self, on: bool) -> None:
        """The ring's stop word; once registered with the native guard, through it (a hazard ending in another
        thread must not clear a stop this executor asked for)."""
        if self._native_handle is not None:
            self._native.hold(self._native_handle, on)
        elif on:
            self.producer.request_stop()
        else:
            self.producer.clear_stop()

    def _launch(self) -> None:
        if self._native_handle is None:  # the interposer's guard steps this block aside before hazardous calls
            from . import guard

            ng = guard.native()
            if ng is not None:
                self._native = ng
                self._native_handle = ng.add(self.mem.host_ptr + R.OFF_STOP, self.mem.host_ptr + R.OFF_STATE)
        self.layout.store32(R.OFF_STATE, R.ConsumerState.NOT_STARTED)  # the new instance takes the word over
        driver.launch(self.image.resident, 1, self.image.threads, self._args, self.stream,
                      what=f"concordia_executor v{self.image.image_id}")
        self._launched = True
        self.launches += 1

    def _check_error(self) -> None:
        if self.state != R.ConsumerState.EXITED_ERROR:
            return
        code = self.layout.load32(R.OFF_ERROR)
        where = f"(head {self.producer.head}, tail {self.tail})"
        if code == R.ConsumerError.BAD_HEADER:
            raise ExecutorError(
                f"executor image v{self.image.image_id} refused the ring: its header is not a protocol-version "
                f"{R.VERSION} ring of capacity {self.options.capacity} {where}; the image and the ring come from "
                "different builds of concordia_ft: close this executor and make a new one")
        name = R.ConsumerError(code).name if code in R.ConsumerError._value2member_map_ else str(code)
        raise ExecutorError(
            f"executor stopped on protocol error {name} at task {self.layout.load(R.OFF_ERROR_SEQ)} {where}: a "
            "descriptor word carried a tag of neither that task nor its slot's previous occupant; the ring was "
            "written by more than one producer or corrupted: close this executor and make a new one")

    def _ensure_running(self) -> None:
        with self._lock:
            if self._suspended or self._closed:
                return
            if self._native is not None and self._native.depth():  # a hazard is open: it would stop at once
                return
            if self._launched:
                if self.state in (R.ConsumerState.NOT_STARTED, R.ConsumerState.RUNNING):
                    return
                self.stream.synchronize()  # the instance has exited (idle, lease): returns at once
                self._launched = False
                self._check_error()
            self._launch()

    def suspend(self) -> None:
        """Make the resident block exit at its next task boundary and wait for it (tasks stay queued)."""
        with self._lock:
            self._suspended = True
            if self._launched:
                self._request_stop(True)
                self.stream.synchronize()
                self._launched = False
                self._request_stop(False)
                self._check_error()

    def resume(self, eager: bool = True) -> None:
        """Allow the executor to run again; ``eager`` relaunches now, else on the next submit/wait."""
        with self._lock:
            self._suspended = False
            if eager or self.producer.head != self.tail:
                self._ensure_running()

    def close(self) -> None:
        """Stop the block and release what this executor holds: its stream, the ring's and the scratch pinned
        memory, and the image when this executor loaded it. Idempotent. Afterwards ``submit`` and ``wait``
        raise ExecutorError; a C fast-path ``submit`` taken before close() publishes into a private copy of the
        ring (``RingProducer.retire``) and raises the same. If stopping the block fails (a poisoned context),
        nothing it might still use is freed and the error propagates."""
        from . import guard

        if self._closed:
            return
        guard.unregister(self)
        with guard.quiesced(eager=False):  # module unload and cuMemFreeHost block behind resident kernels
            with self._lock:
                if self._closed:
                    return
                try:
                    self.suspend()
                except ExecutorError:
                    pass  # the block stopped on a protocol error: it has exited, so releasing is safe
                finally:
                    self._closed = True
                    self.submit = self._submit_closed
                    self.wait = self._wait_closed
                self._release()

    def _release(self) -> None:
        if self._native_handle is not None:  # before the free: the native guard reads these words
            self._native.remove(self._native_handle)
            self._native_handle = None
        tomb = self.producer.retire()  # state words stay readable (state, tail, heartbeat) after the free
        self.layout, self._q, self._u32 = tomb, tomb.q, tomb.u32
        self.stream.close()
        self._scratch.close()
        self.mem.close()
        if self._owns_image:
            self.image.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _submit_closed(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
                       a5: int = 0, aux: int = 0) -> int:
        raise ExecutorError(f"submit on a closed executor (opcode {opcode}): make a new one")

    def _wait_closed(self, ticket: int, timeout_s: float = 10.0) -> int:
        raise ExecutorError(f"wait for task {ticket} on a closed executor: its ring was released; make a new "
                            "executor and submit the task again")

    def swap(self, image_id: int | None = None, compiled: nvrtc.CompiledModule | None = None) -> ExecutorImage:
        """Hand the ring to a new image: compile it (no GPU; pass ``compiled`` to do that ahead), let this one
        exit at a task boundary, load and warm the new one, resume from the ring's tail. Tasks submitted
        meanwhile wait in the ring. Returns the new image; the old module is unloaded."""
        from . import guard

        if self._closed:
            raise ExecutorError("swap on a closed executor: make a new one")
        new_id = image_id if image_id is not None else self.image.image_id + 1
        if compiled is None:
            compiled = compile_executor(new_id, self.image.threads, driver.arch_of(self.device))
        with guard.quiesced():  # suspends this executor too (lock order: guard, then executor)
            new = ExecutorImage(new_id, self.image.threads, self.device, compiled)
            self.warm_up(new)
            old, self.image = self.image, new
            if self._owns_image:
                old.close()
            self._owns_image = True  # the new image was loaded here
        return new

    # -- tasks (``submit`` and ``wait`` are set in __init__: the ring's fast paths)
    def _submit_slow(self, seq: int, opcode: int, a0: int, a1: int, a2: int, a3: int, a4: int, a5: int,
                     aux: int) -> int:
        """The ring was full (``seq`` 0: nothing published yet) or the block is not RUNNING: (re)launch it,
        publish when a slot frees up."""
        if self._closed:
            raise ExecutorError(f"submit on a closed executor (task {seq or 'not published'}): make a new one")
        deadline = time.monotonic() + 10.0
        while not seq:
            self._ensure_running()
            with self._submit_lock:
                seq = self.producer.try_publish(opcode, a0, a1, a2, a3, a4, a5, aux)
            if not seq:
                if time.monotonic() > deadline:
                    raise RingFullError(f"ring full for 10 s (head {self.producer.head}, tail {self.tail}, "
                                        f"state {self.state.name}, suspended {self._suspended})")
                time.sleep(0)
        self._ensure_running()
        return seq

    def _wait_timeout(self, ticket: int, timeout_s: float) -> NoReturn:
        self._check_error()
        raise ExecutorTimeout(f"task {ticket} not done after {timeout_s}s: tail {self.tail}, head "
                              f"{self.producer.head}, state {self.state.name}, suspended {self._suspended}")

    def set_release(self, key: int, flag_addr: int | None, value: int = 0) -> None:
        """Entry ``key`` of the exit-release table (None removes it): stored by the block when it exits."""
        with self._lock:
            if flag_addr is None:
                self._releases.pop(key, None)
            else:
                self._releases[key] = (flag_addr, value)
            self.producer.set_releases(list(self._releases.values()))


# ---------------------------------------------------------------------------------------------- armed

_DESC = struct.Struct("8Q")  # native: one 8-byte store per word, like the ring's


@dataclass(frozen=True)
class _Task:
    opcode: int
    args: tuple[int, ...]
    aux: int


class ArmedChannel:
    """Pre-armed full-width launches: ``depth`` instances of (wait flag >= k -> wide dispatcher reading
    descriptor slot k -> write done = k) wait on a non-blocking stream. ``fire`` writes the descriptor and
    releases one instance: by a host store, or (``fired_by``) by the resident executor's TRIGGER task.

    A pending instance holds a NOP (word 0 tagged NOP, words 1..7 zero), so cancelling (``suspend``: release
    every pending instance) runs nothing, and an instance released while ``fire`` was still writing its
    descriptor runs nothing either (it runs only a descriptor whose 8 words carry one tag) and is fired again by
    ``wait``. Flag values count up and compare cyclically (int32): never released with 0xffffffff.
    """

    kind = "armed"

    def __init__(self, image: ExecutorImage, *, depth: int = 2, grid: int | None = None,
                 fired_by: ResidentExecutor | None = None) -> None:
        from . import guard

        if depth < 1:
            raise ConfigError(f"depth must be >= 1, got {depth}")
        self.image = image
        self.depth = depth
        self.nslots = depth + 1
        self.grid = grid or 4 * driver.sm_count(image.device)
        self.fired_by = fired_by
        # flag u32 @0 (one writer: the host, or the firing executor), done u32 @64 (the stream), descriptor
        # slots @128 (host), ran words after them (device): one per slot
        self._ran_off = 128 + 64 * self.nslots
        self.mem = PinnedBuffer(self._ran_off + 8 * self.nslots)
        self._view = self.mem.view()
        self._view[:] = bytes(self.mem.nbytes)
        self.u32 = self._view.cast("I")
        self.q = self._view.cast("Q")
        self.flag_ptr = self.mem.device_ptr
        self.done_ptr = self.mem.device_ptr + 64
        self.stream = driver.Stream.create(non_blocking=True, device=image.device)
        # the dispatcher reads its descriptor from device memory: a stream-ordered 64-byte copy after the wait
        # (hundreds of blocks each reading host memory over PCIe cost ~0.5 ms, measured)
        self.dev_desc = DeviceBuffer(64 * self.nslots)
        self._slot_args = [driver.KernelArgs([(ctypes.c_uint64, self.dev_desc.ptr + 64 * i),
                                              (ctypes.c_uint64, self.mem.device_ptr + self._ran_off + 8 * i)])
                           for i in range(self.nslots)]
        self._fired_tasks: dict[int, _Task] = {}  # fired, not yet confirmed: ticket -> task
        self.refires = 0
        self.armed = 0
        self.fired = 0
        self._suspended = False
        self._closed = False
        self._lock = threading.RLock()
        self._key = id(self)
        self._arm_up_to_depth()
        guard.register(self)

    def _done(self) -> int:
        return int(self.u32[16])

    def _slot_q(self, k: int) -> int:
        return (128 + 64 * (k % self.nslots)) >> 3

    def _arm(self) -> None:
        k = self.armed + 1
        old = k - self.nslots  # the instance that used this slot must have finished with it
        if old > 0:
            self._wait_done(old, 10.0)
        # the pending NOP: word 0 tagged, words 1..7 zero, so a half-written fire never runs (see wide_at)
        _DESC.pack_into(self._view, self._slot_q(k) << 3, R.encode_words(k, R.Opcode.NOP)[0], 0, 0, 0, 0, 0, 0, 0)
        _stream_wait(self.stream, self.flag_ptr, k)
        slot = k % self.nslots
        driver.memcpy_htod_async(self.dev_desc.ptr + 64 * slot, self.mem.host_ptr + 128 + 64 * slot, 64, self.stream)
        driver.launch(self.image.wide_at, self.grid, DEFAULT_THREADS, self._slot_args[k % self.nslots],
                      self.stream, what="armed wide dispatcher")
        _stream_write(self.stream, self.done_ptr, k)
        self.armed = k
        if self.fired_by is not None:
            self.fired_by.set_release(self._key, self.flag_ptr, k)

    def _arm_up_to_depth(self) -> None:
        while self.armed - self.fired < self.depth:
            self._arm()

    def fire(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
             a5: int = 0, aux: int = 0) -> int:
        """Release the next armed instance with this task; returns its ticket (wait with ``wait``)."""
        task = _Task(opcode, (a0, a1, a2, a3, a4, a5), aux)
        R.check_fields(opcode, task.args, 0, aux)  # before anything is armed or written
        return self._fire(task)

    def _fire(self, task: _Task) -> int:
        with self._lock:
            if self._closed:
                raise ExecutorError(f"fire on a closed ArmedChannel (opcode {task.opcode}): make a new one")
            self._suspended = False
            if self.fired_by is not None and self.armed != self.fired and cyclic_reached(int(self.u32[0]), self.fired + 1):
                self.fired = self.armed  # the executor exited and released the pending instances (as NOPs)
            if self.armed == self.fired:
                self._arm()
            k = self.fired + 1
            _DESC.pack_into(self._view, self._slot_q(k) << 3, *R.encode_words(k, task.opcode, task.args, 0, task.aux))
            self._fired_tasks[k] = task
            if len(self._fired_tasks) > 4 * self.nslots + 64:  # fired and never waited for: forget the oldest
                self._fired_tasks.pop(next(iter(self._fired_tasks)))
            if self.fired_by is None:
                self.u32[0] = k & _U32  # the host store that starts the full-width launch
            else:
                self.fired_by.submit(R.Opcode.TRIGGER, self.flag_ptr, aux=k & _U32)
            self.fired = k
            return k

    submit = fire

    def rearm(self) -> None:
        """Top the pending instances back up to ``depth`` (after fires; costs 3 driver calls each)."""
        with self._lock:
            if not self._suspended and not self._closed:
                self._arm_up_to_depth()

    def _wait_done(self, k: int, timeout_s: float) -> None:
        u = self.u32
        if cyclic_reached(int(u[16]), k):
            return
        deadline = time.monotonic() + timeout_s
        spins = 0
        while not cyclic_reached(int(u[16]), k):
            spins += 1
            if spins & 1023 == 0:
                if self.fired_by is not None:
                    self.fired_by._ensure_running()
                if time.monotonic() > deadline:
                    raise ExecutorTimeout(f"armed launch {k} not done after {timeout_s}s (done word {int(u[16])}, "
                                          f"fired {self.fired}, armed {self.armed})")

    def wait(self, ticket: int, timeout_s: float = 10.0) -> int:
        """Wait for ``ticket``; if an executor exit released its instance before the descriptor was in place
        (it ran a NOP), fire the task again, so a fired task is never lost."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._wait_done(ticket, max(0.0, deadline - time.monotonic()))
            task = self._fired_tasks.pop(ticket, None)
            ran = int(self.q[(self._ran_off >> 3) + ticket % self.nslots])  # word 0 the instance read
            # ran carries another tag when the slot was reused by a later ticket before this wait: nothing
            # left to check (tickets 2**15 apart share a tag, but such an old ticket's task was forgotten)
            if task is None or (ran >> R.TAG_SHIFT) != R.tag_of(ticket) or (ran & 0xFFFF) == task.opcode:
                return 0
            self.refires += 1
            ticket = self._fire(task)

    def suspend(self) -> None:
        """Release every pending instance (they run NOP) and wait for the stream: nothing waits on a flag."""
        with self._lock:
            self._suspended = True
            if self.armed != self.fired:
                # the resident firer (if any) is suspended first by the guard: the host is the only writer now
                self.u32[0] = self.armed & _U32
                self.fired = self.armed
            self.stream.synchronize()
            if self.fired_by is not None:
                self.fired_by.set_release(self._key, None)

    def resume(self, eager: bool = True) -> None:
        with self._lock:
            self._suspended = False
            if eager and not self._closed:
                self._arm_up_to_depth()

    def close(self) -> None:
        """Release every pending instance, then the stream, the device descriptors and the pinned flag
        memory. Idempotent; ``fire`` afterwards raises ExecutorError."""
        from . import guard

        if self._closed:
            return
        guard.unregister(self)
        self.suspend()  # nothing waits on the flag any more: the stream is idle
        with self._lock:
            self._closed = True
        with guard.quiesced(eager=False):  # cuMemFree / cuMemFreeHost block behind resident kernels
            self.dev_desc.close()
            self.stream.close()
            tomb = memoryview(bytearray(self._view))  # the done word and ran words wait() reads
            self._view, self.u32, self.q = tomb, tomb.cast("I"), tomb.cast("Q")
            self.mem.close()


# ---------------------------------------------------------------------------------------------- plain launch


class LaunchExecutor:
    """One launch of the wide dispatcher per task (descriptor by value); wait = stream synchronize."""

    kind = "launch"

    def __init__(self, image: ExecutorImage, *, max_grid: int | None = None) -> None:
        self.image = image
        self.sms = driver.sm_count(image.device)
        self.max_grid = max_grid or 4 * self.sms
        self.stream = driver.Stream.create(non_blocking=True, device=image.device)
        self._args = driver.KernelArgs([(ctypes.c_uint64, 0)] * 8)
        self.tickets = 0
        self._closed = False

    def submit(self, opcode: int, a0: int = 0, a1: int = 0, a2: int = 0, a3: int = 0, a4: int = 0,
               a5: int = 0, aux: int = 0) -> int:
        if self._closed:  # its stream handle is gone: 0 would be the legacy default stream
            raise ExecutorError(f"submit on a closed LaunchExecutor (opcode {opcode}): make a new one")
        words = R.encode_words(self.tickets + 1, opcode, (a0, a1, a2, a3, a4, a5), 0, aux)  # validates
        self.tickets += 1
        for i, w in enumerate(words):
            self._args.set(i, w)
        grid = min(self.max_grid, wide_grid(self.sms, opcode, a3, DEFAULT_THREADS))
        driver.launch(self.image.wide, grid, DEFAULT_THREADS, self._args, self.stream, what="wide dispatcher")
        return self.tickets

    def wait(self, ticket: int, timeout_s: float = 10.0) -> int:
        if self._closed:
            raise ExecutorError(f"wait for task {ticket} on a closed LaunchExecutor")
        self.stream.synchronize()
        return 0

    def suspend(self) -> None:
        if not self._closed:
            self.stream.synchronize()

    def resume(self, eager: bool = True) -> None:
        pass

    def close(self) -> None:
        """Wait for the launched work, destroy the stream. Idempotent."""
        if self._closed:
            return
        self.stream.synchronize()
        self._closed = True
        self.stream.close()


# ---------------------------------------------------------------------------------------------- policy

# Work a single resident block handles itself; above this a full-width launch wins. Measured on the H200
# (experiments/results/executor-h200.json): the ring beats eager PyTorch up to N = 65,536 float32 (256 KiB per
# operand) and loses at 262,144; one block scans ~35-70 GB/s, so a 1 MiB page diff takes 30 us on the ring vs
# 20 us through a plain full-width launch. Full width: a plain launch beat the pre-armed launch on the H200
# (NOP trigger->done 20 us vs 36 us, 256 MiB scan 169 us vs 190 us: the armed path pays a stream-ordered
# descriptor copy and the stream wait's wake-up), so the default for recurring full-width work is "launch";
# ``prefer_armed=True`` keeps the GPU-initiated path (no host launch) selectable.
RING_MAX_BYTES = 256 << 10


def choose_path(kind: RegionKind | str, size_bytes: int, *, recurring: bool = True,
                prefer_armed: bool = False) -> str:
    """'resident', 'armed', 'launch' or 'none' for checkpoint work on a region of ``kind``.

    paged: the dirty-block bitmap is tiny work -> the resident block runs it. dense/opaque: a scan or gather of
    the whole region needs the whole GPU -> a plain full-width launch (measured fastest here), or a pre-armed
    launch when ``prefer_armed`` and the trigger recurs; small regions stay on the resident block.
    immutable/scratch: no per-epoch work.
    """
    k = RegionKind.parse(kind)
    if k in (RegionKind.IMMUTABLE, RegionKind.SCRATCH):
        return "none"
    if k == RegionKind.PAGED or size_bytes <= RING_MAX_BYTES:
        return "resident"
    return "armed" if (recurring and prefer_armed) else "launch"
