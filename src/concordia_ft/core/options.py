"""Options objects given as the dataclass, a dict of its fields, or None (the defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


def coerce_options(cls: type[T], value: T | Mapping[str, Any] | None, what: str) -> T:
    """``value`` as a ``cls``: None gives the defaults, a mapping its fields (an unknown one is a ConfigError)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return cls(**value)
        except TypeError as e:
            raise ConfigError(f"unknown {what} option: {e}") from None
    raise ConfigError(f"{what} options must be {cls.__name__} or a dict, got {type(value).__name__}")
