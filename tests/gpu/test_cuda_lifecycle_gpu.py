"""Lifecycles on a real GPU: executors release what they hold on close(), one handler module per key under
threads, a device-side assert is reported sticky (710), the Triton hook pair stays balanced when a real load
fails, and the thread's context follows ``torch.cuda.set_device``.

Tests that poison the context (the assert) run in a subprocess (``python THIS_FILE assert``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch") if __name__ != "__main__" else __import__("torch")

pytestmark = pytest.mark.gpu
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from concordia_ft.core.regions import RegionKind, RegionSpec  # noqa: E402
from concordia_ft.cuda import driver, nvrtc, trackers  # noqa: E402
from concordia_ft.errors import DeviceError, ExecutorError  # noqa: E402
from concordia_ft.executor import guard  # noqa: E402
from concordia_ft.executor import ring as R  # noqa: E402
from concordia_ft.executor.resident import (  # noqa: E402
    ArmedChannel,
    ExecutorImage,
    ExecutorOptions,
    LaunchExecutor,
    ResidentExecutor,
    run_task,
)


def _device_free_bytes() -> int:
    free, _ = driver.check(driver.bindings().cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def test_resident_executor_close_releases_and_is_idempotent() -> None:
    torch.cuda.init()
    ex = ResidentExecutor(ExecutorOptions(capacity=64, idle_timeout_ms=200))
    assert run_task(ex, R.Opcode.NOP) == 0
    stale_submit = ex.submit  # taken before close (the C fast path when built)
    mem, scratch, stream, module = ex.mem, ex._scratch, ex.stream, ex.image.module
    ex.close()
    assert ex.closed and guard.depth() == 0
    assert mem.host_ptr == 0 and scratch.host_ptr == 0 and stream.handle == 0 and module.handle is None
    assert ex.state in (R.ConsumerState.EXITED_STOP, R.ConsumerState.EXITED_IDLE)  # readable after the free
    ex.close()  # idempotent
    with pytest.raises(ExecutorError, match="closed executor"):
        ex.submit(R.Opcode.NOP)
    with pytest.raises(ExecutorError, match="closed executor"):
        ex.wait(1)
    with pytest.raises(ExecutorError, match="closed executor"):
        stale_submit(R.Opcode.NOP)  # publishes into the retired copy, never into freed pinned memory
    with pytest.raises(ExecutorError, match="closed executor"):
        ex.swap()


def test_closing_executors_gives_their_memory_back() -> None:
    torch.cuda.init()
    ResidentExecutor(ExecutorOptions(capacity=64)).close()  # warm: first-use allocations of the driver
    free0 = _device_free_bytes()
    for _ in range(20):
        ex = ResidentExecutor(ExecutorOptions(capacity=1024))
        run_task(ex, R.Opcode.NOP)
        ex.close()
    lost = free0 - _device_free_bytes()
    print(f"device memory not returned after 20 executors: {lost / 2**20:.1f} MiB")
    assert lost < 8 << 20, f"{lost} bytes of device memory kept by 20 closed executors"


def test_a_borrowed_image_outlives_the_executor_and_other_paths_close() -> None:
    torch.cuda.init()
    with guard.quiesced():
        image = ExecutorImage()
    try:
        ex = ResidentExecutor(ExecutorOptions(capacity=64), image=image)
        armed = ArmedChannel(image, depth=2, fired_by=ex)
        launch = LaunchExecutor(image)
        for path in (ex, armed, launch):
            run_task(path, R.Opcode.NOP)
        armed_mem, armed_stream, launch_stream = armed.mem, armed.stream, launch.stream
        for path in (armed, launch, ex):
            path.close()
            path.close()
        assert image.module.handle is not None  # not ours to unload
        assert armed_mem.host_ptr == 0 and armed_stream.handle == 0 and launch_stream.handle == 0
        with pytest.raises(ExecutorError, match="closed"):
            armed.fire(R.Opcode.NOP)
        with pytest.raises(ExecutorError, match="closed"):
            launch.submit(R.Opcode.NOP)
        assert guard.depth() == 0
        # the image still works for a new executor
        ex2 = ResidentExecutor(ExecutorOptions(capacity=64), image=image)
        assert run_task(ex2, R.Opcode.NOP) == 0
        ex2.close()
    finally:
        with guard.quiesced():
            image.close()


def test_threads_loading_one_geometry_share_one_module() -> None:
    torch.cuda.init()
    d = driver.ensure_context()
    spec = RegionSpec("lifecycle", RegionKind.OPAQUE, 12345 * 7 + 3, page_bytes=512)
    start = threading.Barrier(6)
    got: list[object] = []

    def load() -> None:
        start.wait()
        got.append(trackers.handler_module(spec, d))

    with guard.quiesced():
        threads = [threading.Thread(target=load) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == 6 and len({id(m) for m in got}) == 1


def test_ensure_context_follows_torch_current_device() -> None:
    torch.cuda.init()
    torch.cuda.set_device(0)
    assert driver.ensure_context() == 0
    assert driver.plan_context(0, None, driver._torch_current()) is None  # cached and agreed: no driver call


@pytest.mark.multi_gpu
def test_ensure_context_follows_a_later_set_device() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.init()
    torch.cuda.set_device(0)
    assert driver.ensure_context() == 0
    torch.cuda.set_device(1)
    assert driver.ensure_context() == 1  # the old cache answered 0
    ptr = driver.mem_alloc(4096)
    try:
        assert driver.pointer_device(ptr) == 1
    finally:
        driver.mem_free(ptr)
    torch.cuda.set_device(0)


def test_device_side_assert_is_reported_sticky() -> None:
    env = dict(os.environ)
    r = subprocess.run([sys.executable, __file__, "assert"], capture_output=True, text=True, timeout=180, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    res = json.loads(lines[-1])
    assert res["code"] == 710 and res["sticky"] and "restart the process" in res["message"], res


def assert_main() -> None:
    src = 'extern "C" __global__ void concordia_assert(int* x) { assert(x[0] == 12345); }'
    d = driver.ensure_context()
    mod = nvrtc.Module(nvrtc.compile_cubin(src, "assert", nvrtc.CompileOptions(arch=driver.arch_of(d))), d)
    buf = driver.mem_alloc(4)
    stream = driver.Stream.create()
    driver.memset_d8_async(buf, 0, 4, stream)
    driver.launch(mod.function("concordia_assert"), 1, 1, driver.KernelArgs([(__import__("ctypes").c_uint64, buf)]),
                  stream, what="assert kernel")
    try:
        stream.synchronize()
    except DeviceError as e:
        print(json.dumps({"code": e.code, "sticky": e.sticky, "message": str(e)}))
        return
    print(json.dumps({"code": 0, "sticky": False, "message": "no error"}))


def test_a_real_triton_load_failure_leaves_the_guard_balanced() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ)
    r = subprocess.run([sys.executable, __file__, "triton"], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    res = json.loads(lines[-1])
    assert res["raised"] and res["depth_after_failure"] == 0 and res["depth_after_good"] == 0, res
    assert res["executor_ran"], res


def triton_main() -> None:
    import triton
    import triton.language as tl

    guard.install()
    ex = ResidentExecutor(ExecutorOptions(capacity=64, idle_timeout_ms=500))

    @triton.jit
    def small(xp, B: tl.constexpr):  # type: ignore[no-untyped-def]  # triton reads annotations
        i = tl.arange(0, B)
        tl.store(xp + i, tl.load(xp + i) + 1)

    x = torch.zeros(1 << 20, device="cuda")
    raised = False
    try:  # more threads than a block may have: the load succeeds, then Triton raises before its end hook
        small[(1,)](x, B=1 << 14, num_warps=64)
        torch.cuda.current_stream().synchronize()
    except Exception as e:  # noqa: BLE001 - any load failure will do; what matters is the guard's depth
        raised = True
        print("triton raised:", type(e).__name__, str(e)[:200], file=sys.stderr)
    d1 = guard.depth()
    small[(1,)](x, B=256)
    torch.cuda.current_stream().synchronize()
    d2 = guard.depth()
    ran = run_task(ex, R.Opcode.NOP, timeout_s=5.0) == 0
    ex.close()
    print(json.dumps({"raised": raised, "depth_after_failure": d1, "depth_after_good": d2, "executor_ran": ran}))


if __name__ == "__main__":
    {"assert": assert_main, "triton": triton_main}[sys.argv[1]]()
