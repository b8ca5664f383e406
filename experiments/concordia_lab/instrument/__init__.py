"""Below the framework: safe points in kernels, pause and resume by blocks, and a view of every GPU launch.

- ``safepoints``: the PTX rewriter (pure; CPU-tested against real Triton PTX with ptxas);
- ``triton_hook``: wires the rewriter into Triton's compile pipeline with an isolated cache;
- ``pause``: the host side of cooperative pause/resume on the GPU (control blocks, drain, resume, epochs);
- ``interposer``: the native launch/module observer and its inventory.

Importing this package touches no GPU and imports neither torch nor cuda (DESIGN.md beside this file).
"""

from __future__ import annotations

from .safepoints import (
    REFUSALS,
    KernelReport,
    RewriteResult,
    SafepointOptions,
    decode_bitmap,
    plan_safepoints,
    rewrite_ptx,
)

__all__ = ["REFUSALS", "KernelReport", "RewriteResult", "SafepointOptions", "decode_bitmap",
           "plan_safepoints", "rewrite_ptx"]
