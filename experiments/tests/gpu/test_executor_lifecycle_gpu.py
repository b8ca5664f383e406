"""Executor lifecycles on a real GPU: executors release what they hold on close(), a borrowed image outlives
its executor, and the Triton hook pair stays balanced when a real load fails (``python THIS_FILE triton``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch") if __name__ != "__main__" else __import__("torch")

pytestmark = pytest.mark.gpu
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from concordia_ft.cuda import driver  # noqa: E402
from concordia_lab.errors import ExecutorError  # noqa: E402
from concordia_lab.executor import guard  # noqa: E402
from concordia_lab.executor import ring as R  # noqa: E402
from concordia_lab.executor.resident import (  # noqa: E402
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
    {"triton": triton_main}[sys.argv[1]]()
