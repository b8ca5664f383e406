"""CPU CI: the interposer's native hazard guard (instrument/_interposer.c), driven through its real CUPTI callback
entry point with callback records built as CUPTI lays them out, against a real ring whose device side is the
Python reference consumer (executor.ring.RingConsumer) in a thread. On the H200 the same callback is called by
the driver (tests/gpu/test_instrument_guard_gpu.py)."""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from concordia_ft.errors import CompileError
from concordia_lab.executor import guard
from concordia_lab.executor import ring as R
from concordia_lab.instrument import interposer as ip

try:
    LIB_PATH = ip.build()
except CompileError as e:  # pragma: no cover - only where the wheels' headers are missing
    pytest.skip(f"interposer does not build here: {e}", allow_module_level=True)

DRIVER, RESOURCE = 1, 3
ENTER, EXIT = 0, 1


def _cbids() -> dict[str, int]:
    for d in ip.include_dirs():
        h = d / "cupti_driver_cbid.h"
        if h.exists():
            return {m[1]: int(m[2]) for m in re.finditer(r"CUPTI_DRIVER_TRACE_CBID_(\w+)\s*=\s*(\d+)", h.read_text())}
    raise AssertionError("cupti_driver_cbid.h not found")


CBID = _cbids()


class CallbackData(ctypes.Structure):  # CUpti_CallbackData
    _fields_ = [("callbackSite", ctypes.c_int), ("functionName", ctypes.c_char_p), ("functionParams", ctypes.c_void_p),
                ("functionReturnValue", ctypes.c_void_p), ("symbolName", ctypes.c_char_p),
                ("context", ctypes.c_void_p), ("contextUid", ctypes.c_uint32), ("correlationData", ctypes.c_void_p),
                ("correlationId", ctypes.c_uint32)]


class ResourceData(ctypes.Structure):  # CUpti_ResourceData
    _fields_ = [("context", ctypes.c_void_p), ("stream", ctypes.c_void_p), ("resourceDescriptor", ctypes.c_void_p)]


class ModuleData(ctypes.Structure):  # CUpti_ModuleResourceData
    _fields_ = [("moduleId", ctypes.c_uint32), ("cubinSize", ctypes.c_size_t), ("pCubin", ctypes.c_void_p)]


class Driver:
    """Calls the library's callback the way the driver does around one API call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.cft_callback.restype = None
        lib.cft_callback.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]

    def call(self, api: str, site: int, params: ctypes.Structure | None = None, symbol: bytes = b"k") -> None:
        d = CallbackData(callbackSite=site, functionName=api.encode(), symbolName=symbol,
                         functionParams=ctypes.cast(ctypes.pointer(params), ctypes.c_void_p) if params else None)
        self.lib.cft_callback(None, DRIVER, CBID[api], ctypes.byref(d))

    def module_loaded(self, module_id: int) -> None:
        m = ModuleData(moduleId=module_id, cubinSize=0, pCubin=None)
        r = ResourceData(resourceDescriptor=ctypes.cast(ctypes.pointer(m), ctypes.c_void_p))
        self.lib.cft_callback(None, RESOURCE, 6, ctypes.byref(r))


class LaunchParams(ctypes.Structure):  # cuLaunchKernel_params: the kernel handle first
    _fields_ = [("f", ctypes.c_void_p), ("gridDimX", ctypes.c_uint)]


class LaunchExParams(ctypes.Structure):  # cuLaunchKernelEx_params: the config, then the handle
    _fields_ = [("config", ctypes.c_void_p), ("f", ctypes.c_void_p)]


class LoadDataParams(ctypes.Structure):
    _fields_ = [("module", ctypes.c_void_p), ("image", ctypes.c_char_p)]


class Ring:
    """A ring in ordinary host memory with the reference consumer as its device."""

    def __init__(self, cap: int = 64) -> None:
        self.raw = ctypes.create_string_buffer(R.ring_bytes(cap))
        self.addr = ctypes.addressof(self.raw)
        self.layout = R.RingLayout(memoryview(self.raw).cast("B"), cap)
        self.layout.initialise()
        self.thread: threading.Thread | None = None
        self.exits: list[R.ConsumerState] = []

    @property
    def state(self) -> R.ConsumerState:
        return R.ConsumerState(self.layout.load32(R.OFF_STATE))

    @property
    def stop(self) -> int:
        return self.layout.load32(R.OFF_STOP)

    def start(self) -> None:
        """Launch the consumer (what ResidentExecutor._launch does) and wait until it runs."""
        assert self.thread is None or not self.thread.is_alive()
        self.layout.store32(R.OFF_STATE, R.ConsumerState.NOT_STARTED)
        cons = R.RingConsumer(self.layout)
        self.thread = threading.Thread(target=lambda: self.exits.append(
            cons.run(lambda d: (0, 0), idle_timeout_s=60.0)), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.state != R.ConsumerState.RUNNING:
            assert time.monotonic() < deadline, "the consumer did not start"
            time.sleep(0.001)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(10)
            assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    # a private copy: dlopen of another path is another instance, so these counts never reach other tests
    copy = tmp_path_factory.mktemp("guard") / ip.LIB_NAME
    copy.write_bytes(LIB_PATH.read_bytes())
    return ip.load(copy)


@pytest.fixture()
def drv(lib: ctypes.CDLL) -> Driver:
    return Driver(lib)


@pytest.fixture()
def ng(lib: ctypes.CDLL) -> Iterator[guard.NativeGuard]:
    g = guard.NativeGuard(lib)
    g.set_timeout(10.0)
    yield g
    assert g.depth() == 0


@pytest.fixture()
def ring(ng: guard.NativeGuard) -> Iterator[Ring]:
    r = Ring()
    h = ng.add(r.addr + R.OFF_STOP, r.addr + R.OFF_STATE)
    yield r
    r.layout.store32(R.OFF_STOP, 1)
    r.join()
    ng.remove(h)


def stats(ng: guard.NativeGuard) -> dict[str, int]:
    return {k: v for k, v in ng.stats().items() if isinstance(v, int)}


def test_a_module_load_steps_the_block_aside_before_the_driver_loads(drv: Driver, ng: guard.NativeGuard,
                                                                      ring: Ring) -> None:
    ring.start()
    before = stats(ng)
    p = LoadDataParams(None, b".version 8.7\n.target sm_90a\n")
    drv.call("cuModuleLoadData", ENTER, p)
    # the callback returned: the block has left, and stays out while the load runs
    assert ring.state == R.ConsumerState.EXITED_STOP and ring.stop == 1 and ng.depth() == 1
    drv.module_loaded(901)  # the load itself, inside the window: not an unguarded load
    drv.call("cuModuleLoadData", EXIT, p)
    assert ring.stop == 0 and ng.depth() == 0
    after = stats(ng)
    assert after["stepped_aside"] == before["stepped_aside"] + 1
    assert after["unguarded_loads"] == before["unguarded_loads"]
    assert ring.exits == [R.ConsumerState.EXITED_STOP]
    ring.start()  # what the executor's next submit does: relaunch


@pytest.mark.parametrize("api", ["cuCtxSynchronize", "cuCtxSynchronize_v2", "cuMemFree_v2", "cuMemFreeHost", "cuModuleGetFunction",
                                 "cuLibraryGetKernel", "cuKernelGetFunction", "cuFuncGetAttribute",
                                 "cuGraphInstantiateWithFlags", "cuLibraryLoadData", "cuModuleUnload"])
def test_every_blocking_call_steps_aside(api: str, drv: Driver, ng: guard.NativeGuard, ring: Ring) -> None:
    ring.start()
    drv.call(api, ENTER)
    assert ring.state == R.ConsumerState.EXITED_STOP and ng.depth() == 1
    drv.call(api, EXIT)
    assert ring.stop == 0 and ng.depth() == 0


def test_only_a_kernels_first_launch_steps_aside_until_an_unload(drv: Driver, ng: guard.NativeGuard,
                                                                 ring: Ring) -> None:
    f = LaunchParams(0x7F00_1234_5670, 1)
    ring.start()
    drv.call("cuLaunchKernel", ENTER, f)  # first launch of this handle: lazy loading loads its code here
    assert ring.state == R.ConsumerState.EXITED_STOP and ng.depth() == 1
    drv.call("cuLaunchKernel", EXIT, f)
    assert ng.depth() == 0
    ring.start()
    n = stats(ng)["stepped_aside"]
    for _ in range(100):  # launched before: the hot path does not touch the block
        drv.call("cuLaunchKernel", ENTER, f)
        assert ng.depth() == 0
        drv.call("cuLaunchKernel", EXIT, f)
    assert ring.state == R.ConsumerState.RUNNING and stats(ng)["stepped_aside"] == n
    ex = LaunchExParams(None, 0x7F00_1234_5680)  # cuLaunchKernelEx carries the handle second
    drv.call("cuLaunchKernelEx_ptsz", ENTER, ex)
    assert ring.state == R.ConsumerState.EXITED_STOP
    drv.call("cuLaunchKernelEx_ptsz", EXIT, ex)
    drv.call("cuLaunchKernelEx", ENTER, ex)  # the same handle through the other entry point: seen already
    assert ng.depth() == 0
    drv.call("cuLaunchKernelEx", EXIT, ex)
    drv.call("cuModuleUnload", ENTER)  # handle values can be reused after an unload: forget them all
    drv.call("cuModuleUnload", EXIT)
    ring.start()
    drv.call("cuLaunchKernel", ENTER, f)
    assert ring.state == R.ConsumerState.EXITED_STOP
    drv.call("cuLaunchKernel", EXIT, f)


def test_hazards_in_two_threads_keep_the_block_out_until_the_last_returns(lib: ctypes.CDLL, ng: guard.NativeGuard,
                                                                          ring: Ring) -> None:
    ring.start()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        lib.cft_guard_enter()
        a_in.set()
        b_in.wait(10)
        lib.cft_guard_leave()
        a_out.set()

    t = threading.Thread(target=a)
    t.start()
    assert a_in.wait(10)
    lib.cft_guard_enter()
    b_in.set()
    assert a_out.wait(10)
    assert ng.depth() == 1 and ring.stop == 1  # A returned; B's call is still open
    lib.cft_guard_leave()
    t.join()
    assert ng.depth() == 0 and ring.stop == 0


def test_a_ring_registered_inside_a_hazard_is_told_to_stop(lib: ctypes.CDLL, ng: guard.NativeGuard) -> None:
    lib.cft_guard_enter()
    r = Ring()
    h = ng.add(r.addr + R.OFF_STOP, r.addr + R.OFF_STATE)
    try:
        assert r.stop == 1
    finally:
        lib.cft_guard_leave()
        assert r.stop == 0
        ng.remove(h)


def test_a_block_that_never_leaves_costs_the_timeout_not_a_hang(lib: ctypes.CDLL, ng: guard.NativeGuard) -> None:
    r = Ring()
    r.layout.store32(R.OFF_STATE, R.ConsumerState.RUNNING)  # "running" with nothing consuming: a wedged block
    h = ng.add(r.addr + R.OFF_STOP, r.addr + R.OFF_STATE)
    before = stats(ng)["timeouts"]
    ng.set_timeout(0.05)
    try:
        t0 = time.perf_counter()
        lib.cft_guard_enter()
        dt = time.perf_counter() - t0
        lib.cft_guard_leave()
    finally:
        ng.set_timeout(10.0)
        ng.remove(h)
    assert 0.045 <= dt < 5.0
    assert stats(ng)["timeouts"] == before + 1


def test_exited_and_removed_rings_are_not_waited_for(lib: ctypes.CDLL, ng: guard.NativeGuard) -> None:
    r = Ring()
    r.layout.store32(R.OFF_STATE, R.ConsumerState.EXITED_IDLE)
    h = ng.add(r.addr + R.OFF_STOP, r.addr + R.OFF_STATE)
    n = stats(ng)["stepped_aside"]
    lib.cft_guard_enter()
    lib.cft_guard_leave()
    assert stats(ng)["stepped_aside"] == n  # nothing was resident: nothing to wait for
    ng.remove(h)
    r.layout.store32(R.OFF_STATE, R.ConsumerState.RUNNING)
    ng.set_timeout(5.0)
    t0 = time.perf_counter()
    lib.cft_guard_enter()
    lib.cft_guard_leave()
    assert time.perf_counter() - t0 < 1.0 and r.stop == 0  # removed: never stopped, never waited for
    ng.set_timeout(10.0)


def test_a_module_loaded_outside_every_guarded_call_is_reported(drv: Driver, ng: guard.NativeGuard,
                                                                ring: Ring) -> None:
    before = ng.stats()
    drv.module_loaded(4242)  # an executor is registered and no guarded call is open: a miss
    after = ng.stats()
    assert after["unguarded_loads"] == before["unguarded_loads"] + 1
    assert {"module": 4242, "in": "?"} in after["unguarded"]
    f = LaunchParams(0x7F00_4242_0000, 1)
    drv.call("cuLaunchKernel", ENTER, f)
    drv.module_loaded(4243)  # a lazy load inside a first launch: guarded
    drv.call("cuLaunchKernel", EXIT, f)
    assert ng.stats()["unguarded_loads"] == after["unguarded_loads"]


def test_the_guard_is_not_found_where_the_driver_did_not_load_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_INJECTION64_PATH", raising=False)
    assert guard.native(recheck=True) is None
    monkeypatch.setenv("CUDA_INJECTION64_PATH", str(LIB_PATH))  # loaded in this process, but never subscribed
    assert guard.native(recheck=True) is None
    # and install() then keeps the Python hooks' behaviour (nothing native to lean on)
    assert guard.install(torch_hooks=False, triton_hooks=False) == []


def test_a_hazard_ending_keeps_the_executors_own_stop_request(lib: ctypes.CDLL, ng: guard.NativeGuard) -> None:
    r = Ring()
    h = ng.add(r.addr + R.OFF_STOP, r.addr + R.OFF_STATE)
    try:
        ng.hold(h, True)  # the executor is suspending itself (stop, then wait for its stream)
        lib.cft_guard_enter()
        lib.cft_guard_leave()  # another thread's hazard ends meanwhile
        assert r.stop == 1  # still asked to stop: its stream sync would otherwise wait out the idle timeout
        ng.hold(h, False)
        assert r.stop == 0
        lib.cft_guard_enter()
        ng.hold(h, False)  # released by the executor while a hazard is open: stays stopped until it ends
        assert r.stop == 1
        lib.cft_guard_leave()
        assert r.stop == 0
    finally:
        ng.remove(h)


def test_the_cuda13_synchronize_entry_has_the_number_the_library_uses() -> None:
    # _interposer.c names cuCtxSynchronize_v2 by number (CFT_CBID_cuCtxSynchronize_v2): it must be the header's
    src = (Path(ip.__file__).parent / "_interposer.c").read_text()
    n = int(re.search(r"#define CFT_CBID_cuCtxSynchronize_v2 \(\(CUpti_CallbackId\)(\d+)\)", src)[1])
    assert CBID["cuCtxSynchronize_v2"] == n
