"""CPU CI: the launch cut's state machine inside the interposer library (the code the driver's launch callback
runs), with the two driver calls it makes replaced by host functions that do what the driver would do in
stream order here (copy the bytes; run the host function). Which kernels have safe points is read from a real
cubin: ptxas output of real Triton PTX rewritten by the safe-point rewriter. The cut on the driver is tested
on the H200 (tests/gpu/test_instrument_launchcut_gpu.py)."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from concordia_lab.errors import CompileError, InstrumentError
from concordia_lab.instrument import interposer as ip
from concordia_lab.instrument import launchcut as lc

try:
    LIB_PATH = ip.build()
except CompileError as e:  # pragma: no cover - only where the wheels' headers are missing
    pytest.skip(f"interposer does not build here: {e}", allow_module_level=True)

# CUPTI driver callback ids (cupti_driver_cbid.h, CUDA 13)
CB_LAUNCH_KERNEL, CB_LAUNCH_KERNEL_EX, CB_GRAPH_LAUNCH, CB_LAUNCH = 307, 652, 514, 115

MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
HOSTFN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
HOST_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class LaunchParams(ctypes.Structure):  # cuLaunchKernel_params
    _fields_ = [("f", ctypes.c_void_p), *[(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "shmem")],
                ("stream", ctypes.c_void_p), ("args", ctypes.c_void_p), ("extra", ctypes.c_void_p)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [*[(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "shmem")],
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint)]


class LaunchExParams(ctypes.Structure):  # cuLaunchKernelEx_params
    _fields_ = [("config", ctypes.POINTER(LaunchConfig)), ("f", ctypes.c_void_p), ("args", ctypes.c_void_p),
                ("extra", ctypes.c_void_p)]


class GraphParams(ctypes.Structure):  # cuGraphLaunch_params
    _fields_ = [("exec", ctypes.c_void_p), ("stream", ctypes.c_void_p)]


class Driver:
    """Stands in for cuMemcpyDtoHAsync and cuLaunchHostFunc: records the stream of each call; the host
    function runs at once, or later (run_pending) to model a GPU that has not reached the copies yet."""

    def __init__(self, lib: ctypes.CDLL, *, fail_copy: int = 0, defer: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.pending: list[tuple[int, int]] = []
        self.fail_copy, self.defer = fail_copy, defer
        self._m, self._h = MEMCPY(self._copy), HOSTFN(self._host)
        lib.cft_cut_set_driver(ctypes.cast(self._m, ctypes.c_void_p), ctypes.cast(self._h, ctypes.c_void_p))

    def _copy(self, dst: int, src: int, n: int, stream: int | None) -> int:
        self.calls.append(("copy", stream or 0))
        if self.fail_copy:
            return self.fail_copy
        ctypes.memmove(dst, src, n)
        return 0

    def _host(self, stream: int | None, fn: int, arg: int | None) -> int:
        self.calls.append(("host", stream or 0))
        if self.defer:
            self.pending.append((fn, arg or 0))
        else:
            HOST_CB(fn)(arg)
        return 0

    def run_pending(self) -> None:
        for fn, arg in self.pending:
            HOST_CB(fn)(arg)
        self.pending.clear()


@pytest.fixture()
def lib():  # type: ignore[no-untyped-def]
    lib = lc.bind(ip.load(LIB_PATH))
    lib.cft_cut_cancel()
    yield lib
    lib.cft_cut_cancel()
    lib.cft_cut_wait(0)
    lib.cft_cut_set_driver(None, None)


def launch(lib: ctypes.CDLL, kernel: str, stream: int = 0, cbid: int = CB_LAUNCH_KERNEL) -> None:
    p = LaunchParams(stream=stream)
    lib.cft_cut_on_launch(cbid, ctypes.byref(p), kernel.encode())


def settle(lib: ctypes.CDLL) -> None:
    """Finish whatever cut an earlier test left in flight (the library is one per process)."""
    Driver(lib)
    lib.cft_cut_cancel()
    launch(lib, "settle")


def test_the_next_launch_enqueues_the_copies_before_itself_on_its_stream(lib: ctypes.CDLL) -> None:
    settle(lib)
    drv = Driver(lib)
    cut = lc.LaunchCut(lib)
    src = [np.arange(1000, dtype=np.int64) * k for k in (1, 3)]
    dst = [np.zeros(1000, dtype=np.int64) for _ in src]
    launch(lib, "before_arm", stream=5)
    cut.arm([(s.ctypes.data, d.ctypes.data, s.nbytes) for s, d in zip(src, dst, strict=True)], only_sass=False)
    assert cut.wait(0.01) is None  # no launch yet: still armed
    assert not dst[0].any()
    launch(lib, "crossing", stream=0x77)
    info = cut.wait(1.0)
    assert info is not None and info.state == "landed"
    assert info.kernel_before == "before_arm" and info.kernel_after == "crossing" and info.stream == 0x77
    assert info.api == "cuLaunchKernel"
    assert drv.calls == [("copy", 0x77), ("copy", 0x77), ("host", 0x77)]  # copies, then the landed marker
    for s, d in zip(src, dst, strict=True):
        assert np.array_equal(s, d)
    launch(lib, "after", stream=0x77)  # one cut per arm: later launches copy nothing
    assert len(drv.calls) == 3


def test_every_launch_form_gives_its_stream_and_legacy_ones_are_passed_over(lib: ctypes.CDLL) -> None:
    settle(lib)
    drv = Driver(lib)
    cut = lc.LaunchCut(lib)
    a, b = np.ones(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=False)
    lib.cft_cut_on_launch(CB_LAUNCH, None, b"legacy_cuLaunch")  # no stream to order the copies on
    lib.cft_cut_on_launch(CB_LAUNCH_KERNEL, None, b"no_params")
    assert drv.calls == []
    cfg = LaunchConfig(stream=0x1234)
    ex = LaunchExParams(config=ctypes.pointer(cfg))
    lib.cft_cut_on_launch(CB_LAUNCH_KERNEL_EX, ctypes.byref(ex), b"ex_kernel")
    info = cut.wait(1.0)
    assert info is not None and info.api == "cuLaunchKernelEx" and info.stream == 0x1234
    assert info.kernel_before == "no_params" and info.kernel_after == "ex_kernel"
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=False)
    g = GraphParams(stream=0x99)
    lib.cft_cut_on_launch(CB_GRAPH_LAUNCH, ctypes.byref(g), None)
    info = cut.wait(1.0)
    assert info is not None and info.api == "cuGraphLaunch" and info.stream == 0x99 and info.kernel_after == "<graph>"


def test_only_sass_lets_kernels_with_safe_points_pass(lib: ctypes.CDLL) -> None:
    from concordia_lab.instrument.ptxas import assemble, find_ptxas
    from concordia_lab.instrument.safepoints import SafepointOptions, rewrite_ptx

    if find_ptxas() is None:
        pytest.skip("no ptxas (Triton's bundled one) here")
    from test_instrument_ptx import ptx_of

    src = ptx_of("softmax")
    res = rewrite_ptx(src, SafepointOptions())
    (rep,) = res.kernels
    plain = assemble(src).cubin
    assert lib.cft_cut_on_module(plain, len(plain)) == 0
    assert not lib.cft_cut_has_safepoints(rep.name.encode())
    rewritten = assemble(res.ptx).cubin  # its symbol table holds cft_ctl_<kernel>
    assert lib.cft_cut_on_module(rewritten, len(rewritten)) == 1
    assert lib.cft_cut_has_safepoints(rep.name.encode())
    assert lib.cft_cut_on_module(b"not an elf" * 10, 100) == -1
    settle(lib)
    drv = Driver(lib)
    cut = lc.LaunchCut(lib)
    a, b = np.ones(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=True)
    launch(lib, rep.name)  # pausable inside: the cut waits for a SASS-only kernel
    assert drv.calls == [] and cut.wait(0.01) is None
    launch(lib, "ampere_sgemm_128x64_nn")
    info = cut.wait(1.0)
    assert info is not None and info.kernel_before == rep.name and info.kernel_after == "ampere_sgemm_128x64_nn"
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=False)
    launch(lib, rep.name)  # any kernel may cross
    info = cut.wait(1.0)
    assert info is not None and info.kernel_after == rep.name


def test_wait_returns_only_after_the_host_function_ran(lib: ctypes.CDLL) -> None:
    settle(lib)
    drv = Driver(lib, defer=True)
    cut = lc.LaunchCut(lib)
    a, b = np.ones(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=False)
    launch(lib, "k")
    assert cut.info().state == "enqueued" and cut.wait(0.02) is None
    with pytest.raises(InstrumentError, match="already armed or in flight"):
        cut.arm([], only_sass=False)
    assert not cut.cancel()  # taken by a launch: it cannot be withdrawn, it lands
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(cut.wait(5.0)))
    t.start()
    drv.run_pending()
    t.join(5)
    assert got and isinstance(got[0], lc.CutInfo) and got[0].state == "landed"


def test_a_refused_copy_fails_the_cut_with_the_drivers_code(lib: ctypes.CDLL) -> None:
    settle(lib)
    drv = Driver(lib, fail_copy=700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    cut = lc.LaunchCut(lib)
    a, b = np.ones(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)] * 2, only_sass=False)
    launch(lib, "k")
    info = cut.wait(1.0)
    assert info is not None and info.state == "failed" and info.error == 700
    assert drv.calls == [("copy", 0)]  # stopped at the first refusal, no landed marker
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=False)  # a failed cut does not block the next
    assert cut.cancel() and cut.info().state == "idle"


def test_a_stale_host_function_does_not_land_a_newer_cut(lib: ctypes.CDLL) -> None:
    settle(lib)
    drv = Driver(lib, defer=True)
    cut = lc.LaunchCut(lib)
    a, b = np.ones(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=False)
    launch(lib, "k")
    stale = list(drv.pending)
    drv.run_pending()
    assert cut.wait(1.0) is not None
    cut.arm([(a.ctypes.data, b.ctypes.data, a.nbytes)], only_sass=False)
    for fn, arg in stale:  # the first cut's marker arriving again must not land the second
        HOST_CB(fn)(arg)
    assert cut.info().state == "armed"


def test_no_cut_without_a_driver() -> None:
    lib = lc.bind(ip.load(LIB_PATH))
    lib.cft_cut_set_driver(None, None)
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is installed here")
    except OSError:
        pass
    with pytest.raises(InstrumentError, match="no CUDA driver"):
        lc.LaunchCut(lib).arm([], only_sass=False)


def test_a_cut_requested_ahead_lands_at_that_launch_and_not_before(lib: ctypes.CDLL) -> None:
    settle(lib)
    drv = Driver(lib)
    cut = lc.LaunchCut(lib)
    src = np.arange(64, dtype=np.int32)
    dst = np.zeros(64, dtype=np.int32)
    target = cut.launch_seq() + 3
    cut.arm([(src.ctypes.data, dst.ctypes.data, src.nbytes)], only_sass=False, at_launch=target)
    launch(lib, "first")
    launch(lib, "second")
    assert cut.wait(0.01) is None and drv.calls == []  # two launches passed: not yet theirs
    launch(lib, "third")
    info = cut.wait(1.0)
    assert info is not None and info.state == "landed" and info.launch == target
    assert info.kernel_before == "second" and info.kernel_after == "third"
    assert np.array_equal(src, dst)
    with pytest.raises(InstrumentError, match="issued already"):  # a launch number in the past is refused
        cut.arm([(src.ctypes.data, dst.ctypes.data, src.nbytes)], only_sass=False, at_launch=target)
    assert cut.wait(0.01) is not None and cut.info().launch == target  # and the refused arm changed nothing
