"""Epoch boundaries from PyTorch without changing the application: a dispatch-level trigger.

``BoundaryTrigger`` is a ``TorchDispatchMode`` that calls ``on_boundary(op)`` after every op that is a
checkpoint boundary: a collective (``c10d::*`` in eager code, ``_c10d_functional::*`` and ``wait_tensor`` in
functional/compiled code) and, optionally, named extern ops (``aten::mm`` etc.). It declares
``ignore_compile_internals() == True``: Dynamo compiles frames while it is active (a mode without that makes
Dynamo skip the frame, and the frame then stays eager even after the mode exits), and at run time the mode
sees only the dispatcher calls the compiled artifact makes: collectives and extern kernels, exactly the
boundaries, not the fused kernels between them (tests/test_instrument_boundaries.py checks both; the cost per
op: experiments/results/boundaries-cpu.json).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


def op_name(func: Any) -> str:
    """``namespace::name`` of an OpOverload (``c10d::allreduce_``, ``aten::mm``)."""
    return str(func._schema.name)


class BoundaryTrigger(TorchDispatchMode):
    """Call ``on_boundary(op_name)`` after collectives (and ``extern_ops``) run through the dispatcher."""

    def __init__(self, on_boundary: Callable[[str], None], *, extern_ops: Iterable[str] = (),
                 collectives: bool = True) -> None:
        super().__init__()
        self.on_boundary = on_boundary
        self.extern_ops = frozenset(extern_ops)
        self.collectives = collectives
        self.ops_seen = 0
        self.boundaries = 0
        self._is_boundary: dict[Any, bool] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _classify(self, func: Any) -> bool:
        name = op_name(func)
        ns = name.split("::", 1)[0]
        hit = (self.collectives and ns in COLLECTIVE_NAMESPACES) or name in self.extern_ops
        self._is_boundary[func] = hit
        return hit

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops_seen += 1
        hit = self._is_boundary.get(func)
        if hit is None:
            hit = self._classify(func)
        if hit:
            self.boundaries += 1
            self.on_boundary(op_name(func))
        return out
