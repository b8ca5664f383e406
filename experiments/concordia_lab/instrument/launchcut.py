"""Epoch boundaries between kernel launches, for kernels without safe points (SASS-only: PyTorch eager, cuBLAS).

A kernel that the PTX rewriter did not instrument cannot be paused inside, so its checkpoint point is a launch
boundary. The interposer's launch callback (``_launchcut.c``, in the same library) places it: ``arm()`` from
any thread; the next launch the filter accepts enqueues, before itself and on its own stream, device-to-host
copies of the registered regions and a host function that marks the cut landed. The copies then hold the
state after every launch before the boundary and before the one that crossed it, in stream order, with no
synchronisation of the program. ``SassBoundary`` turns that into a Runtime epoch (regions mirrored in pinned
host memory). DESIGN.md beside this file, section "SASS-only kernels", has the semantics and the numbers.
"""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InstrumentError
from . import interposer as ip

IDLE, ARMED, TAKEN, ENQUEUED, LANDED, FAILED = range(6)
STATE_NAMES = ("idle", "armed", "taken", "enqueued", "landed", "failed")


class CutCopy(ctypes.Structure):
    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.cft_cut_arm.restype = ctypes.c_int
    lib.cft_cut_arm.argtypes = [ctypes.POINTER(CutCopy), ctypes.c_uint64, ctypes.c_int]
    lib.cft_cut_arm_at.restype = ctypes.c_int
    lib.cft_cut_arm_at.argtypes = [ctypes.POINTER(CutCopy), ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64]
    lib.cft_cut_wait.restype = ctypes.c_int
    lib.cft_cut_wait.argtypes = [ctypes.c_int64]
    lib.cft_cut_cancel.restype = ctypes.c_int
    lib.cft_cut_info.restype = ctypes.c_size_t
    lib.cft_cut_info.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.cft_cut_kernel.restype = None
    lib.cft_cut_kernel.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.cft_cut_on_launch.restype = None
    lib.cft_cut_on_launch.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_char_p]
    lib.cft_cut_on_module.restype = ctypes.c_int
    lib.cft_cut_on_module.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    lib.cft_cut_has_safepoints.restype = ctypes.c_int
    lib.cft_cut_has_safepoints.argtypes = [ctypes.c_char_p]
    lib.cft_cut_set_driver.restype = None
    lib.cft_cut_set_driver.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


@dataclass(frozen=True)
class CutInfo:
    state: str
    launch: int  # the interposer's launch number of the launch that crossed the boundary (1-based)
    api: str  # cuLaunchKernel, cuLaunchKernelEx or cuGraphLaunch
    stream: int  # the CUstream handle the copies went to
    kernel_before: str  # the last launch before the boundary (any stream)
    kernel_after: str  # the launch that crossed it
    error: int  # CUresult of the first driver call that refused (state "failed")


class LaunchCut:
    """One cut at a time over the interposer loaded into this process (``interposer.activate()`` or
    ``child_env()``); ``lib`` is for tests that drive the library without a driver."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self.lib = bind(lib or ip.load())
        self._copies: Any = None

    def arm(self, copies: Sequence[tuple[int, int, int]], *, only_sass: bool = True,
            at_launch: int | None = None) -> None:
        """copies: (device address, pinned host address, bytes). only_sass: only a launch of a kernel without
        safe points may cross (a rewritten kernel is paused inside instead); False: the next launch of any.
        at_launch: the cut is not taken before the launch with this number (``launch_seq() + k`` is the k-th
        launch from now), so it lands at a definite launch however late the program issues it."""
        arr = (CutCopy * max(1, len(copies)))(*[CutCopy(s, d, n) for s, d, n in copies])
        self._copies = arr
        at = int(at_launch or 0)
        if at_launch is not None and at < 1:
            raise InstrumentError(f"at_launch {at_launch}: launch numbers start at 1")
        r = int(self.lib.cft_cut_arm_at(arr, len(copies), 1 if only_sass else 0, at))
        if r == -3:
            raise InstrumentError(f"launch {at} was issued already (the last was {self.launch_seq()}): the cut "
                                  "cannot land there; ask for a later launch number")
        if r == 0:
            raise InstrumentError("a launch cut is already armed or in flight: wait() for it or cancel() it first")
        if r == -1:
            raise InstrumentError("the launch cut found no CUDA driver (libcuda.so.1) in this process")
        if r < 0:
            raise InstrumentError("the launch cut could not allocate its copy list")

    def wait(self, timeout_s: float) -> CutInfo | None:
        """The cut once its copies have landed (or failed); None if no launch crossed it in time (it stays
        armed: wait again, or cancel())."""
        st = int(self.lib.cft_cut_wait(int(timeout_s * 1000)))
        if st not in (LANDED, FAILED):
            return None
        return self.info()

    def launch_seq(self) -> int:
        """The number of the last launch call the interposer saw in this process (0: none yet)."""
        buf = ctypes.create_string_buffer(512)
        self.lib.cft_cut_info(buf, len(buf))
        return int(json.loads(buf.value.decode())["launch_seq"])

    def cancel(self) -> bool:
        return bool(self.lib.cft_cut_cancel())

    def info(self) -> CutInfo:
        buf = ctypes.create_string_buffer(512)
        self.lib.cft_cut_info(buf, len(buf))
        d = json.loads(buf.value.decode())
        names = []
        for side in (0, 1):
            nb = ctypes.create_string_buffer(256)
            self.lib.cft_cut_kernel(side, nb, len(nb))
            names.append(nb.value.decode(errors="replace"))
        return CutInfo(STATE_NAMES[int(d["state"])], int(d["cut_seq"]), str(d["api"]), int(d["stream"]),
                       names[0], names[1], int(d["error"]))


class SassBoundary:
    """Runtime epochs cut between kernel launches: each CUDA tensor in ``regions`` is mirrored in pinned host
    memory and the mirror registered with ``rt`` under the tensor's name (an opaque region: the epoch logs the
    pages that changed). ``checkpoint()`` may be called from any thread while the program runs."""

    def __init__(self, rt: Any, regions: Mapping[str, Any], *, only_sass: bool = True,
                 lib: ctypes.CDLL | None = None) -> None:
        import torch

        self.rt = rt
        self.only_sass = only_sass
        self.cut = LaunchCut(lib)
        self._pairs: list[tuple[Any, Any]] = []
        for name, t in regions.items():
            if not (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous()):
                raise InstrumentError(f"region {name!r}: SassBoundary mirrors contiguous CUDA tensors only")
            mirror = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8).pin_memory()
            rt.register(name, mirror.numpy(), kind="opaque")
            self._pairs.append((t, mirror))
        self.last: CutInfo | None = None
        self.last_landed_s = 0.0  # request -> copies landed
        self.last_commit_s = 0.0  # landed -> epoch committed
        self._requested_s = time.perf_counter()

    def request(self, at_launch: int | None = None) -> None:
        """Arm the cut (``LaunchCut.arm``) and return at once; ``commit()`` waits for it and commits."""
        self._requested_s = time.perf_counter()
        self.cut.arm([(t.data_ptr(), m.data_ptr(), m.numel()) for t, m in self._pairs], only_sass=self.only_sass,
                     at_launch=at_launch)

    def checkpoint(self, timeout_s: float = 10.0, meta: Any = None, *, at_launch: int | None = None) -> int:
        """Cut at the next launch boundary (``at_launch``: at the first accepted launch numbered at least that,
        see ``LaunchCut.arm``), wait until the copies landed, commit them as one epoch; returns its number.
        Raises InstrumentError when no launch crossed in ``timeout_s`` (the cut is withdrawn)."""
        self.request(at_launch)
        return self.commit(timeout_s, meta)

    def commit(self, timeout_s: float = 10.0, meta: Any = None) -> int:
        """The second half of ``checkpoint``: wait for the cut that ``request()`` armed to land, commit it."""
        t0 = self._requested_s
        info = self.cut.wait(timeout_s)
        if info is None:
            if not self.cut.cancel():  # a launch took it meanwhile: it lands shortly
                info = self.cut.wait(timeout_s)
            if info is None:
                raise InstrumentError(f"no kernel launch crossed the boundary within {timeout_s} s (the program is "
                                      "idle or blocked): checkpoint directly, the GPU is between launches")
        if info.state != "landed":
            raise InstrumentError(f"the launch cut failed: the driver refused a copy (CUresult {info.error})")
        self.last = info
        t1 = time.perf_counter()
        self.last_landed_s = t1 - t0
        cut = {"launch": info.launch, "api": info.api, "kernel_before": info.kernel_before,
               "kernel_after": info.kernel_after, "landed_s": self.last_landed_s}
        epoch = int(self.rt.checkpoint(meta={"launch_cut": cut, "user": meta}))
        self.last_commit_s = time.perf_counter() - t1
        return epoch
