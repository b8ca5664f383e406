"""GPU: the interposer, loaded by the driver into an unmodified PyTorch + Triton + cuBLAS process, sees
PyTorch's own modules (cudart's private path), Triton's cuModuleLoadData, cuBLAS kernels, and counts every
launch exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from concordia_lab.instrument import interposer as ip

TESTS = Path(__file__).resolve().parents[1]

APP = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, %r)
    import instrument_kernels as ik
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    for _ in range(7):
        ik.softmax_kernel[(4,)](x, y, 1000, 1024, BLOCK=1024)
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        b = a @ a
    for _ in range(5):
        x.mul_(1.0001)
    torch.cuda.synchronize()
    from concordia_lab.instrument import interposer as ip
    inv = ip.inventory()
    print(json.dumps({"launches": inv.launches, "modules": [m.__dict__ for m in inv.modules],
                      "summary": inv.summary()}, default=list))
""") % str(TESTS)


def test_interposer_sees_torch_triton_and_cublas() -> None:
    env = ip.child_env()
    env["PYTHONPATH"] = f"{Path(ip.__file__).resolve().parents[2]}:{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-c", APP], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout + r.stderr
    got = json.loads(lines[-1])
    launches = got["launches"]
    assert launches.get("softmax_kernel") == 7  # exact count of a Triton launch (cuLaunchKernelEx via dlsym)
    triton_mods = [m for m in got["modules"] if "softmax_kernel" in m["kernels"]]
    assert triton_mods and triton_mods[0]["api"] == "cuModuleLoadData" and triton_mods[0]["image"] == "cubin"
    assert any(m["api"] is None for m in got["modules"])  # PyTorch's kernels: cudart's private load path
    mul = [k for k, v in launches.items() if "MulFunctor" in ip.demangle(k) or "mul" in ip.demangle(k).lower()]
    assert mul and sum(launches[k] for k in mul) >= 5
    gemm = [k for k in launches if any(s in ip.demangle(k).lower() for s in ("gemm", "sm90", "cutlass", "xmma"))]
    assert gemm, sorted(launches)[:40]
