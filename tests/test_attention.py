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


def test_invariant_mode_off_the_gpu_says_what_it_needs() -> None:
    from concordia_ft.errors import ConfigError
    from concordia_ft.serve import Engine
    from llm_helpers import tiny_model

    if A.interpreted():
        pytest.skip("Triton's interpreter is on: the mode runs on the CPU then")
    with pytest.raises(ConfigError, match="invariant=True runs Triton kernels on the GPU"):
        Engine(tiny_model("qwen3"), None, {"checkpoint": False, "invariant": True})


def test_more_query_heads_per_kv_head_than_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="query heads per K/V head"):
        A.block_q(A.M_ROWS + 1)
