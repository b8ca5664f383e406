"""Concordia-FT: keep long-running LLM sessions alive through GPU, process and communicator failures.

Importing this package touches no GPU and imports no torch: heavy parts load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    CompactionError,
    CompactionWarning,
    CompileError,
    ConcordiaError,
    ConfigError,
    DeviceError,
    LogCorruptError,
    LogError,
    RecoveryError,
    RegionError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompactionError",
    "CompactionWarning",
    "CompileError",
    "ConcordiaError",
    "ConfigError",
    "DeviceError",
    "LogCorruptError",
    "LogError",
    "PendingEpoch",
    "Recovered",
    "RecoveryError",
    "RegionError",
    "Runtime",
    "Session",
    "recover",
]

_LAZY = {
    "Runtime": ("concordia_ft.runtime", "Runtime"),
    "recover": ("concordia_ft.runtime", "recover"),
    "Recovered": ("concordia_ft.runtime", "Recovered"),
    "PendingEpoch": ("concordia_ft.runtime", "PendingEpoch"),
    "Session": ("concordia_ft.session", "Session"),
}

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import PendingEpoch, Recovered, Runtime, recover
    from .session import Session


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'concordia_ft' has no attribute {name!r}")
