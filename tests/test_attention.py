"""The paged attention kernel (serve/attention.py) on the CPU through Triton's interpreter: it matches a float64
reference, a request's rows are bit-identical alone, among other requests, at another position in the batch,
chunked at any size and as a decode step, and an engine running it gives transformers' own tokens. Each case
runs in a process of its own (tests/attention_cases.py). The GPU twin (tests/gpu/test_attention_gpu.py) runs
the compiled kernel in bf16."""

from __future__ import annotations

import subprocess

import pytest

from concordia_ft.serve import attention as A
from support import PYTHON, REPO, subprocess_env

pytest.importorskip("triton")


# the engine cases run a whole engine through the interpreter (minutes on two cores): the slow suite; the kernel
# cases (float64 reference, invariance, linear) stay in the fast run
@pytest.mark.parametrize("case", ["reference1", "reference2", "reference3", "invariance", "linear",
                                  pytest.param("engine", marks=pytest.mark.slow),
                                  pytest.param("invariant_engine", marks=pytest.mark.slow)])
def test_kernel_case(case: str) -> None:
    r = subprocess.run([PYTHON, str(REPO / "tests" / "attention_cases.py"), case], capture_output=True, text=True,
                       env=subprocess_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"ok {case}" in r.stdout


def test_invariant_mode_on_the_cpu_runs_torch_ops_and_stays_off_by_default() -> None:
    """Without Triton's interpreter a CPU model takes invariant=True (serve/invariant.py's torch ops and
    invariant.TorchAttention: tests/test_invariant_cpu.py) and runs a step; the default stays off on the CPU."""
    import sys

    from concordia_ft.serve import Engine, SamplingParams
    from llm_helpers import tiny_model

    if A.interpreted():
        pytest.skip("Triton's interpreter is on: the mode runs the Triton kernels on the CPU then")
    model = tiny_model("qwen3")
    eng = Engine(model, None, {"checkpoint": False, "invariant": True})
    assert eng.opts.invariant and eng.kernel
    r = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0.0))
    while eng.has_work:
        eng.step()
    assert len(r.generated) == 2
    assert not A.interpreted() and eng.device.type == "cpu"
    off = Engine(tiny_model("qwen3"), None, {"checkpoint": False})
    assert off.opts.invariant is False and not off.kernel
    assert "triton.language" not in sys.modules or A._kernel is None  # the CPU path built no Triton kernel


def test_more_query_heads_per_kv_head_than_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="query heads per K/V head"):
        A.block_q(A.M_ROWS + 1)
