"""Finishing a paused launch on the CPU: run only chosen blocks of a Triton kernel in Triton's interpreter.

``TRITON_INTERPRET=1`` (set before the kernel's module is imported) makes ``@triton.jit`` functions run in
Python on host tensors, every block in turn. ``run_blocks`` runs just the listed block indexes (the pending
blocks of a paused launch, ``(z * ny + y) * nx + x`` as the probes number them), so a launch paused on a
GPU can be completed where no GPU is left. The interpreter's arithmetic is numpy's, not the GPU's: blocks it
runs match the same blocks of a full interpreted launch bit for bit, and the GPU's result only to rounding.
``run_blocks(..., range(n))`` is that full launch: Triton 3.6's own interpreter loop fails under NumPy >= 2.4
on any loop with a run-time bound, which this executor works around.

Uses the interpreter's grid executor internals (``GridExecutor`` helpers), checked for Triton 3.6.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import InstrumentError

TESTED_TRITON = ("3.6.",)


def _grid3(grid: int | Sequence[int]) -> tuple[int, int, int]:
    g = [grid] if isinstance(grid, int) else list(grid)
    g = (g + [1, 1])[:3]
    return int(g[0]), int(g[1]), int(g[2])


def run_blocks(fn: Any, grid: int | Sequence[int], args: Sequence[Any], kwargs: dict[str, Any] | None,
               blocks: Iterable[int]) -> int:
    """Run ``blocks`` of ``fn[grid](*args, **kwargs)`` in Triton's interpreter; returns how many ran."""
    import triton
    from triton.runtime import interpreter as tin

    if not triton.__version__.startswith(TESTED_TRITON):
        raise InstrumentError(f"run_blocks uses Triton {TESTED_TRITON[0]}x interpreter internals; found "
                              f"{triton.__version__}")
    if not isinstance(fn, tin.InterpretedFunction):
        raise InstrumentError(f"{getattr(fn, '__name__', fn)!r} is not an interpreted Triton function: set "
                              "TRITON_INTERPRET=1 before the module that defines the kernel is imported")
    g = _grid3(grid)
    n = g[0] * g[1] * g[2]
    todo = sorted(set(int(b) for b in blocks))
    if todo and not (0 <= todo[0] and todo[-1] < n):
        raise InstrumentError(f"block indexes must lie in [0, {n}) for grid {g}; got {todo[0]}..{todo[-1]}")
    ex = _block_executor()(fn.rewrite(), fn.arg_names, g, fn.pre_run_hooks, todo)
    ex(*args, **(kwargs or {}))
    return len(todo)


def _scalar_index(self: Any) -> int:
    data = self.handle.data
    if data.size != 1:
        raise TypeError(f"only a scalar converts to an index, not a block of shape {data.shape}")
    return int(data.reshape(-1)[0])


@functools.lru_cache(maxsize=1)
def _block_executor() -> Any:
    """GridExecutor over a chosen list of blocks (built on first use: importing triton is not free)."""
    from triton.runtime import interpreter as tin

    class BlockExecutor(tin.GridExecutor):  # type: ignore[misc]
        def __init__(self, fn: Any, arg_names: list[str], grid: tuple[int, int, int], hooks: list[Any],
                     blocks: list[int]) -> None:
            super().__init__(fn, arg_names, grid, hooks)
            self.blocks = blocks

        def __call__(self, *args_dev: Any, **kwargs: Any) -> None:  # GridExecutor.__call__, over chosen blocks
            argspec = inspect.getfullargspec(self.fn)
            kwargs = {k: v for k, v in kwargs.items() if k in argspec.args}
            args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
            for hook in self.pre_run_hooks:
                hook(*args_hst, **kwargs_hst)
            # Triton 3.6's interpreter converts a scalar with int(ndarray of shape (1,)), which NumPy >= 2.4
            # refuses: every loop with a run-time bound fails. Its tensor patch is re-applied by nested
            # patches (each reduction's combine function), so wrap the patcher itself while we run.
            orig_patch = tin._patch_lang_tensor

            def patch_tensor(tensor: Any, scope: Any) -> None:
                orig_patch(tensor, scope)
                scope.set_attr(tensor, "__index__", _scalar_index)

            tin._patch_lang_tensor = patch_tensor
            patch_scope = tin._patch_lang(self.fn)
            try:
                call = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
                call = {k: v if k in self.constexprs else tin._implicit_cvt(v) for k, v in call.items()}
                nx, ny, nz = self.grid
                tin.interpreter_builder.set_grid_dim(nx, ny, nz)
                for b in self.blocks:
                    tin.interpreter_builder.set_grid_idx(b % nx, (b // nx) % ny, b // (nx * ny))
                    self.fn(**call)
            finally:
                patch_scope.restore()
                tin._patch_lang_tensor = orig_patch
            self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    return BlockExecutor
