"""The experiments' tests: ``python -m pytest experiments/tests`` from the checkout's root (not in CI's default
run, which collects tests/ only). concordia_lab (experiments/) and the product (src/) are put on the path of
this process and of every child a test starts; tests/support.py is shared with the product's tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
EXPERIMENTS = HERE.parent
REPO = EXPERIMENTS.parent
for p in (REPO / "src", REPO / "tests", EXPERIMENTS, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(EXPERIMENTS)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [it for it in items if "experiments/tests/gpu/" in str(it.fspath).replace("\\", "/")]
    for it in gpu:
        it.add_marker(pytest.mark.gpu)
    if not gpu:
        return
    try:
        import torch

        ok = bool(torch.cuda.is_available())
    except ImportError:
        ok = False
    if not ok:
        for it in gpu:
            it.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
