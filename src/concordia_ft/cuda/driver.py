"""The CUDA driver: lazy initialisation, error translation, contexts, streams, events, launches, copies.

This is the only module that initialises CUDA, and it does so lazily: importing it (or ``concordia_ft.cuda``)
touches no GPU and needs no driver. The first call that needs the device runs ``cuInit`` and makes the
device's *primary* context current in the calling thread, the same context PyTorch uses, so pointers, streams
and modules are shared with torch (when torch is loaded, its current device is the default).

Every driver result goes through :func:`check`, which turns a failure into
``DeviceError(code, name, sticky, what, explanation)`` from the table in ``results.py``. ``sticky`` errors
(illegal address, device-side assert, launch failure, ECC...) poison the context: nothing more can run in this
process, the restart-and-recover path must take over.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import DeviceError

# the table lives in results.py; these names stay importable from here
from .results import STICKY_CODES as STICKY_CODES
from .results import explain as explain
from .results import is_sticky as is_sticky
from .results import result_name

_lock = threading.Lock()
_initialised = False
_primary: dict[int, Any] = {}  # device ordinal -> retained primary CUcontext
_tls = threading.local()


def bindings() -> Any:
    """The ``cuda.bindings.driver`` module, imported on first use (ConfigError-free: DeviceError if absent)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DeviceError(-1, "CUDA_BINDINGS_MISSING", False,
                          f"import cuda.bindings ({e}); install the 'cuda' extra: pip install 'concordia-ft[cuda]'"
                          ) from None
    return drv


def error_name(code: int) -> str:
    return result_name(code)


def check(result: Any, what: str) -> Any:
    """Check a cuda.bindings result tuple ``(CUresult, *values)``; return the value(s) or raise DeviceError."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    code = int(err)
    if code != 0:
        raise DeviceError(code, error_name(code), is_sticky(code), what, explain(code))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _init() -> None:
    global _initialised
    if _initialised:
        return
    with _lock:
        if not _initialised:
            drv = bindings()
            try:
                result = drv.cuInit(0)
            except Exception as e:  # noqa: BLE001 - libcuda.so missing: no driver on this machine
                raise DeviceError(-2, "CUDA_DRIVER_MISSING", False,
                                  f"cuInit: the NVIDIA driver library could not be loaded ({e}); this machine "
                                  "has no usable GPU: use the CPU backend") from None
            check(result, "cuInit")
            _initialised = True


def cuda_available() -> bool:
    """True when a CUDA device can be used. Never raises; initialises the driver if it is there."""
    try:
        return device_count() > 0
    except DeviceError:
        return False


def device_count() -> int:
    _init()
    return int(check(bindings().cuDeviceGetCount(), "cuDeviceGetCount"))


def _torch_device() -> int | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available():
            torch.cuda.init()  # torch creates (retains) the primary context first: we share it
            return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - torch's CUDA state is optional here
        return None
    return None


def _torch_current() -> int | None:
    """torch's current device in this thread when torch has initialised CUDA (it follows
    ``torch.cuda.set_device`` and the thread's current context), else None. Never initialises anything."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - torch's CUDA state is optional here
        return None


def plan_context(cached: int | None, requested: int | None, torch_current: int | None) -> int | None:
    """The device whose primary context must be made current, or None when the thread's cached one stands.

    ``cached``: the device this thread last made current here; ``requested``: the caller's device (None: the
    current one); ``torch_current``: torch's current device (None: torch has no CUDA state). The cache stands
    only when it is what was asked for AND torch has not moved the thread elsewhere since (a later
    ``torch.cuda.set_device`` or a torch device guard changes the thread's current context under us). -1 means
    "the default": torch's current device if torch has one, else device 0 (resolved by the caller)."""
    want = requested if requested is not None else torch_current
    if cached is not None and (want is None or want == cached) and (torch_current is None or torch_current == cached):
        return None
    return want if want is not None else -1


def ensure_context(device: int | None = None) -> int:
    """Make ``device``'s primary context current in this thread (torch's current device by default); return
    the ordinal. Cheap after the first call in a thread for the same device; a later
    ``torch.cuda.set_device`` is followed (see :func:`plan_context`)."""
    cached = getattr(_tls, "device", None)
    planned = plan_context(cached, device, _torch_current())
    if planned is None and cached is not None:
        return int(cached)
    _init()
    drv = bindings()
    if planned is None or planned < 0:
        planned = _torch_device()
        if planned is None:
            planned = 0
    device = planned
    n = device_count()
    if not 0 <= device < n:
        raise DeviceError(101, "CUDA_ERROR_INVALID_DEVICE", False,
                          f"ensure_context: device {device} asked for, this process sees {n} device(s)")
    with _lock:
        ctx = _primary.get(device)
        if ctx is None:
            dev = check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
            ctx = check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device})")
            _primary[device] = ctx
    check(drv.cuCtxSetCurrent(ctx), f"cuCtxSetCurrent(device {device})")
    _tls.device = device
    return device


def device_attribute(name: str, device: int | None = None) -> int:
    """``name`` without the prefix, e.g. 'MULTIPROCESSOR_COUNT'."""
    d = ensure_context(device)
    drv = bindings()
    attr = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    dev = check(drv.cuDeviceGet(d), "cuDeviceGet")
    return int(check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


def sm_count(device: int | None = None) -> int:
    return device_attribute("MULTIPROCESSOR_COUNT", device)


def compute_capability(device: int | None = None) -> tuple[int, int]:
    return (device_attribute("COMPUTE_CAPABILITY_MAJOR", device),
            device_attribute("COMPUTE_CAPABILITY_MINOR", device))


def arch_of(device: int | None = None) -> str:
    major, minor = compute_capability(device)
    return f"sm_{major}{minor}"


def synchronize() -> None:
    """Context-wide synchronize (blocks behind a resident kernel: prefer Stream.synchronize)."""
    ensure_context()
    check(bindings().cuCtxSynchronize(), "cuCtxSynchronize")


class Stream:
    """A CUDA stream: owned (created here, non-blocking by default) or borrowed (a torch stream's handle)."""

    def __init__(self, handle: int, *, owned: bool, device: int) -> None:
        self.handle = int(handle)
        self.owned = owned
        self.device = device

    @classmethod
    def create(cls, *, non_blocking: bool = True, device: int | None = None) -> Stream:
        d = ensure_context(device)
        drv = bindings()
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else drv.CUstream_flags.CU_STREAM_DEFAULT
        s = check(drv.cuStreamCreate(flags), "cuStreamCreate")
        return cls(int(s), owned=True, device=d)

    @classmethod
    def borrow(cls, handle: int, device: int | None = None) -> Stream:
        """Wrap an existing stream handle (e.g. ``torch.cuda.current_stream().cuda_stream``)."""
        return cls(handle, owned=False, device=ensure_context(device))

    @classmethod
    def from_torch(cls, device: int | None = None) -> Stream:
        """torch's current stream on ``device``. ``torch._C._cuda_getCurrentRawStream`` gives the handle without
        building a ``torch.cuda.Stream`` (~20 us less per call on a slow host; trackers ask once per epoch);
        the public path is the fallback where that private hook is missing."""
        import torch

        d = ensure_context(device)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        handle = raw(d) if raw is not None else torch.cuda.current_stream(d).cuda_stream
        return cls(int(handle), owned=False, device=d)

    def synchronize(self) -> None:
        check(bindings().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait_event(self, event: Event) -> None:
        """Work enqueued on this stream after this call waits for ``event`` (no host synchronisation)."""
        check(bindings().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def close(self) -> None:
        if self.owned and self.handle:
            check(bindings().cuStreamDestroy(self.handle), "cuStreamDestroy")
        self.handle = 0

    def __repr__(self) -> str:
        return f"Stream({self.handle:#x}, owned={self.owned}, device={self.device})"


class Event:
    """A timing event (``record`` on a stream, ``elapsed_ms`` between two recorded events)."""

    def __init__(self, *, timing: bool = True) -> None:
        ensure_context()
        drv = bindings()
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(drv.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        check(bindings().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        check(bindings().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        return float(check(bindings().cuEventElapsedTime(self.handle, end.handle), "cuEventElapsedTime"))

    def close(self) -> None:
        if self.handle is not None:
            check(bindings().cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


class KernelArgs:
    """Kernel arguments packed once into a ``void*[]`` (launches then pass one integer address).

    ``values`` are (ctypes type, value) pairs, e.g. ``(ctypes.c_uint64, ptr)``. ``set(i, value)`` updates one
    argument in place, so hot paths rebuild nothing.
    """

    def __init__(self, values: Sequence[tuple[type[Any], int | float]]) -> None:
        self._cells = [ctype(v) for ctype, v in values]
        self._array = (ctypes.c_void_p * max(1, len(self._cells)))(
            *[ctypes.addressof(c) for c in self._cells]
        )
        self.address = ctypes.addressof(self._array) if self._cells else 0

    def set(self, index: int, value: int | float) -> None:
        self._cells[index].value = value


def launch(function: Any, grid: int | tuple[int, int, int], block: int | tuple[int, int, int],
           args: KernelArgs, stream: Stream, *, shared_bytes: int = 0, what: str = "kernel") -> None:
    g = (grid, 1, 1) if isinstance(grid, int) else grid
    b = (block, 1, 1) if isinstance(block, int) else block
    check(bindings().cuLaunchKernel(function, g[0], g[1], g[2], b[0], b[1], b[2], shared_bytes, stream.handle,
                                    args.address, 0), f"cuLaunchKernel({what})")


def mem_alloc(nbytes: int) -> int:
    ensure_context()
    return int(check(bindings().cuMemAlloc(max(1, nbytes)), f"cuMemAlloc({nbytes})"))


def mem_free(ptr: int) -> None:
    if ptr:
        check(bindings().cuMemFree(ptr), "cuMemFree")


def memcpy_dtoh_async(dst_host: int, src_device: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        check(bindings().cuMemcpyDtoHAsync(dst_host, src_device, nbytes, stream.handle), "cuMemcpyDtoHAsync")


def memcpy_htod_async(dst_device: int, src_host: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        check(bindings().cuMemcpyHtoDAsync(dst_device, src_host, nbytes, stream.handle), "cuMemcpyHtoDAsync")


def memcpy_dtod_async(dst_device: int, src_device: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        check(bindings().cuMemcpyDtoDAsync(dst_device, src_device, nbytes, stream.handle), "cuMemcpyDtoDAsync")


def memset_d8_async(dst_device: int, value: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        check(bindings().cuMemsetD8Async(dst_device, value, nbytes, stream.handle), "cuMemsetD8Async")


def pointer_device(ptr: int) -> int:
    """The device ordinal a device pointer belongs to."""
    drv = bindings()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(check(drv.cuPointerGetAttribute(attr, ptr), "cuPointerGetAttribute(DEVICE_ORDINAL)"))
