"""Shared fixtures: DRAM (tmpfs) scratch directories, the `gpu` skip, and subprocess helpers.

`gpu` tests are skipped only when no CUDA device is usable (torch missing or torch.cuda unavailable): a real
setup failure, never a bug turned into a skip. torch is imported only when a collected test carries the
marker, so CPU CI pays nothing for it. tests/gpu/conftest.py (another owner) may add GPU-only fixtures.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import PYTHON, REPO, SRC, subprocess_env  # noqa: F401  (re-exported for fixtures)


def _cuda_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False (no CUDA device on this machine)"
    return True, ""


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """A pytest-xdist worker per CPU core when the selection excludes GPU tests (the README's and CI's runs:
    most tests wait on a subprocess, a model load or a SIGKILLed child) and no ``-n`` was given; one process
    otherwise, so GPU tests never share the device between workers and a targeted run starts no workers.
    Here rather than in pyproject's addopts so that a machine without pytest-xdist still runs pytest."""
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("numprocesses", None) is not None:
        return
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # an xdist worker: it must not start workers of its own (each would again, without end)
    if "not gpu" in (config.getoption("markexpr") or "") and not config.getoption("usepdb"):
        config.option.numprocesses = len(os.sched_getaffinity(0))
        if config.getoption("dist", "no") in ("no", "load"):
            config.option.dist = "worksteal"  # an idle worker takes queued tests from a busy one: no long tail


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    ok, why = _cuda_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on tmpfs (/dev/shm), removed afterwards; falls back to /tmp where there is none."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else Path("/tmp")
    path = root / f"cft-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
