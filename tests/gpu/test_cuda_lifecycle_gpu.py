"""Lifecycles on a real GPU: one handler module per key under threads, a device-side assert is reported sticky
(710), and the thread's context follows ``torch.cuda.set_device``.

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
from concordia_ft.errors import DeviceError  # noqa: E402


def test_threads_loading_one_geometry_share_one_module() -> None:
    torch.cuda.init()
    d = driver.ensure_context()
    spec = RegionSpec("lifecycle", RegionKind.OPAQUE, 12345 * 7 + 3, page_bytes=512)
    start = threading.Barrier(6)
    got: list[object] = []

    def load() -> None:
        start.wait()
        got.append(trackers.handler_module(spec, d))

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


if __name__ == "__main__":
    {"assert": assert_main}[sys.argv[1]]()
