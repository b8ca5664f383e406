"""CPU CI: a paused launch finishes where no GPU is left. The pending blocks of a Triton kernel run in
Triton's interpreter in a fresh process, from the launch's Runtime epoch, and the output is bit-equal to an
uninterrupted interpreted launch (softmax and layernorm on 1-D grids, a matmul on a 2-D grid, which checks
the probes' block numbering against the interpreter's program ids). The uninterrupted launch is
run_blocks over every block: Triton 3.6's own interpreter loop fails under NumPy >= 2.4 on loops with
run-time bounds (layernorm, matmul), which run_blocks works around."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

from support import subprocess_env  # noqa: E402

TESTS = Path(__file__).resolve().parent

PAUSE = textwrap.dedent("""
    import os, random, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, {tests!r})
    import instrument_kernels as ik
    from concordia_lab.instrument.interpret import run_blocks
    from concordia_lab.instrument.pause import checkpoint_paused
    from concordia_lab.instrument.safepoints import CTL_BITMAP, ctl_bytes
    from concordia_ft.runtime import Runtime

    torch.manual_seed(0)
    random.seed(1)
    name = {name!r}
    if name == "softmax":
        x = torch.randn(16, 1000)
        out = torch.full_like(x, float("nan"))
        fn, grid, args, kw, ref = ik.softmax_kernel, (16, 1, 1), [x, out, 1000, 1000], dict(BLOCK=1024), \\
            torch.softmax(x.double(), 1)
    elif name == "layernorm":
        x, w, b = torch.randn(8, 1500), torch.randn(1500), torch.randn(1500)
        out = torch.full_like(x, float("nan"))
        fn, grid, args, kw = ik.layernorm_kernel, (8, 1, 1), [x, out, w, b, 1500, 1500, 1e-5], dict(BLOCK=512)
        ref = torch.nn.functional.layer_norm(x.double(), (1500,), w.double(), b.double(), 1e-5)
    else:
        a, bm = torch.randn(384, 128).half(), torch.randn(128, 256).half()
        out = torch.full((384, 256), float("nan"))
        fn, grid = ik.matmul_kernel, (3, 2, 1)
        args = [a, bm, out, 384, 256, 128, 128, 1, 256, 1, 256, 1]
        kw = dict(BM=128, BN=128, BK=64)
        ref = a.double() @ bm.double()
    n = grid[0] * grid[1] * grid[2]
    full = out.clone()
    full_args = list(args)
    full_args[2 if name == "matmul" else 1] = full
    run_blocks(fn, grid, full_args, kw, range(n))  # the uninterrupted launch
    rel = ((full.double() - ref).norm() / ref.norm()).item()
    assert rel < (1e-2 if name == "matmul" else 1e-5), rel
    done = sorted(random.sample(range(n), n // 2))
    assert run_blocks(fn, grid, args, kw, done) == len(done)  # the part that ran before the pause
    assert torch.isnan(out).any() and not torch.equal(out, full)
    ctl = torch.zeros(ctl_bytes(n) // 4, dtype=torch.int32)
    for blk in done:
        ctl[CTL_BITMAP // 4 + blk // 32] |= 1 << (blk % 32)
    rt = Runtime(sys.argv[1], fsync="always")
    checkpoint_paused(rt, fn, grid, args, kw, ctl)
    rt.close()
    torch.save(full, sys.argv[2])
    print("PAUSED", n - len(done))
""")

FINISH = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, {tests!r})
    from concordia_lab.instrument.pause import finish_from_log
    t = finish_from_log(sys.argv[1], device="cpu")
    want = torch.load(sys.argv[2])
    got = t["paused.arg2" if {name!r} == "matmul" else "paused.arg1"]
    print("BITEQ", torch.equal(got, want), int(torch.isnan(got).sum()))
""")


@pytest.mark.parametrize("name", ["softmax", "layernorm", "matmul"])
def test_paused_launch_finishes_on_the_cpu_in_a_fresh_process(name: str, tmp_path: Path) -> None:
    env = subprocess_env()
    env.pop("TRITON_INTERPRET", None)
    log, want = str(tmp_path / "log"), str(tmp_path / "want.pt")
    p = subprocess.run([sys.executable, "-c", PAUSE.format(tests=str(TESTS), name=name), log, want],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0 and "PAUSED" in p.stdout, p.stdout + p.stderr[-3000:]
    f = subprocess.run([sys.executable, "-c", FINISH.format(tests=str(TESTS), name=name), log, want],
                       capture_output=True, text=True, timeout=300, env=env)
    assert f.returncode == 0, f.stdout + f.stderr[-3000:]
    assert "BITEQ True 0" in f.stdout, f.stdout


def test_run_blocks_refuses_a_compiled_kernel() -> None:
    from concordia_lab.errors import InstrumentError
    from concordia_lab.instrument.interpret import run_blocks

    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("this process runs the interpreter")
    import instrument_kernels as ik

    with pytest.raises(InstrumentError, match="TRITON_INTERPRET=1"):
        run_blocks(ik.softmax_kernel, (4,), [], {}, [0])
