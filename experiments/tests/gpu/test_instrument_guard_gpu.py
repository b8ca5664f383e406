"""GPU: with the interposer loaded by the driver, a resident executor that never leaves by itself stays attached
through eager first launches, cuBLAS's first call, a new Triton kernel, a torch.compile'd function, empty_cache,
a device-wide synchronize and a Qwen3 build + decode, with no Python hooks: zero hangs, counted by a per-step
watchdog that ends a stuck step instead of hanging CI. The control (no interposer, no hooks) must hang at
cuBLAS's first call, and the watchdog must catch it: the test can fail."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "experiments"))  # bench_guard

from bench_guard import problems, run_workload  # noqa: E402

pytestmark = pytest.mark.gpu


def test_executor_stays_attached_through_a_users_workload_with_zero_hangs() -> None:
    g = run_workload(guarded=True, step_timeout=15.0)  # a stuck step ends in 15 s (compile: its own 300 s)
    sync = next((r for r in g.get("rows", []) if r.get("step") == "synchronize"), {})
    print(json.dumps({"wall_s": g.get("wall_s"), "hangs": g.get("hangs"),
                      "synchronize": {k: v for k, v in sync.items() if k.startswith("sync")},
                      "stepped_aside": [r.get("stepped_aside") for r in g.get("rows", [])]}))
    assert problems(g) == [], g


def test_without_the_guard_the_watchdog_catches_the_hang() -> None:
    c = run_workload(guarded=False, steps="cublas", step_timeout=8.0, trace=False)
    assert c["hangs"] == 1 and c["hung_step"] == "cublas" and c["watchdog"], c
