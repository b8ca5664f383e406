"""Exact whatever else is in the batch, through crashes, on the CPU: a tiny Qwen3 engine with the batch-invariant
kernels (under Triton's interpreter) serves requests, greedy and seeded, with arrivals that differ after each
SIGKILL and recovery; every final stream equals the request run alone (benchmarks/bench_invariance.py, whose
H200 run is results/invariance-h200.json). Twice: under Triton's interpreter (the Triton kernels' semantics; the
interpreter runs every kernel in numpy) and with the CPU's torch ops (serve/invariant.py; about 35 s on two
cores, mostly the three processes' start: past the fast suite's budget). Both slow."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from support import PYTHON, REPO, subprocess_env

pytest.importorskip("triton")


def _run(tmp_path, env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    r = subprocess.run([PYTHON, str(REPO / "benchmarks" / "bench_invariance.py"), "--quick", "--device", "cpu",
                        "--requests", "8", "--kills", "2", "--invariant", "on", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "invariance-quick.json").read_text())
    row = doc["rows"][0]
    assert row["equal_to_alone"] == row["requests"] == 8
    assert row["stream_errors"] == 0 and len(row["kills"]) == 2
    assert os.path.getsize(tmp_path / "invariance-quick.json") > 0


@pytest.mark.slow
def test_streams_equal_the_request_alone_across_sigkills_with_other_arrivals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _run(tmp_path, {**subprocess_env(), "TRITON_INTERPRET": "1"})


@pytest.mark.slow
def test_the_cpu_torch_ops_keep_streams_equal_to_the_request_alone_across_sigkills(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = subprocess_env()
    env.pop("TRITON_INTERPRET", None)
    _run(tmp_path, env)
