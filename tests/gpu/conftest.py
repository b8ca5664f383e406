"""GPU tests: every test here needs a CUDA device (marker ``gpu``); they skip only when none exists."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the H200 device machine)")
    has = _has_cuda()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not has:
                item.add_marker(skip)
