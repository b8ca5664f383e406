"""Serving many requests over one paged KV pool, crash-safe: the engine (``Engine``), its block pool and
attention, and the OpenAI-compatible HTTP server (``http``). See DESIGN.md beside this file."""

from __future__ import annotations

from .blocks import BlockPool, blocks_for
from .engine import Engine, EngineOptions, Request, StepOutput
from .sampling import SamplingParams

__all__ = ["BlockPool", "Engine", "EngineOptions", "Request", "SamplingParams", "StepOutput", "blocks_for"]
