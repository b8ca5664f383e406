"""The hazard guard: get resident kernels and armed stream waits out of the way of calls that block on them.

While a kernel stays resident (or a stream waits on a flag) the driver blocks module loads (the first launch
of any kernel, a new NVRTC/Triton/cupy module, the first cuBLAS call), device-wide synchronize and cudaFree
(DESIGN.md §3). The guard keeps a registry of what is resident here (executors, armed channels) and
suspends all of it around such calls:

- ``quiesced()``: a re-entrant context manager (the Runtime's ``rt.quiesced()`` calls it);
- ``install()``: hooks torch.cuda.synchronize and torch.cuda.empty_cache, and Triton's
  ``knobs.runtime.kernel_load_start_hook`` / ``kernel_load_end_hook``;
- what no hook catches (a cold eager kernel, cuBLAS's first call, a cupy module) stalls only until the
  executor's idle timeout or lease ends: it exits by itself and is relaunched on the next submit.

Hooks resume lazily (the executor relaunches on its next submit), so the kernel that was just loaded gets its
first launch in before anything is resident again; ``quiesced()`` resumes eagerly unless told otherwise.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Suspendable(Protocol):
    kind: str

    def suspend(self) -> None: ...

    def resume(self, eager: bool = True) -> None: ...


_lock = threading.RLock()
_targets: list[weakref.ref[Any]] = []
_depth = 0
_suspended: list[Suspendable] = []
_installed: dict[str, tuple[Any, str, Any]] = {}
stats = {"suspends": 0, "hook_calls": 0}


def register(target: Suspendable) -> None:
    with _lock:
        _targets.append(weakref.ref(target))
        if _depth:  # registered inside a quiesced region: stay out until it ends
            target.suspend()
            _suspended.append(target)


def unregister(target: Suspendable) -> None:
    with _lock:
        _targets[:] = [r for r in _targets if r() is not None and r() is not target]


def targets() -> list[Suspendable]:
    with _lock:
        live = [t for t in (r() for r in _targets) if t is not None]
    # resident executors first: an armed channel fired by an executor is released once its firer is gone
    return sorted(live, key=lambda t: 0 if t.kind == "resident" else 1)


def enter() -> None:
    """Suspend everything registered (first entry only; nested entries count)."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            stats["suspends"] += 1
            for t in targets():
                t.suspend()
                _suspended.append(t)


def leave(eager: bool = True) -> None:
    global _depth
    with _lock:
        if _depth == 0:
            raise RuntimeError("guard.leave() without enter()")
        _depth -= 1
        if _depth == 0:
            todo = list(reversed(_suspended))
            _suspended.clear()
            for t in todo:
                t.resume(eager)


@contextmanager
def quiesced(eager: bool = True) -> Iterator[None]:
    """Nothing of ours is resident or waiting on a flag inside this block: module loads, device-wide
    synchronize and cudaFree proceed. Tasks submitted meanwhile stay queued in the ring."""
    enter()
    try:
        yield
    finally:
        leave(eager)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        stats["hook_calls"] += 1
        with quiesced(eager=False):
            return fn(*args, **kwargs)

    guarded.__concordia_guarded__ = fn  # type: ignore[attr-defined]
    return guarded


def _patch(key: str, owner: Any, name: str) -> None:
    orig = getattr(owner, name)
    if getattr(orig, "__concordia_guarded__", None) is not None:
        return
    _installed[key] = (owner, name, orig)
    setattr(owner, name, _guarded(orig))


def _on_load_start(*args: Any, **kwargs: Any) -> None:
    stats["hook_calls"] += 1
    enter()


def _on_load_end(*args: Any, **kwargs: Any) -> None:
    leave(eager=False)


def install(*, torch_hooks: bool = True, triton_hooks: bool = True) -> list[str]:
    """Install the hooks (idempotent); returns what was hooked."""
    done: list[str] = []
    with _lock:
        if torch_hooks:
            import torch

            _patch("torch.cuda.synchronize", torch.cuda, "synchronize")
            _patch("torch.cuda.empty_cache", torch.cuda, "empty_cache")
            if hasattr(torch.cuda, "memory") and hasattr(torch.cuda.memory, "empty_cache"):
                _patch("torch.cuda.memory.empty_cache", torch.cuda.memory, "empty_cache")
            done += ["torch.cuda.synchronize", "torch.cuda.empty_cache"]
        if triton_hooks and "triton" not in _installed:
            try:
                from triton import knobs
            except ImportError:
                knobs = None
            if knobs is not None:
                rt = knobs.runtime
                for attr, hook in (("kernel_load_start_hook", _on_load_start), ("kernel_load_end_hook", _on_load_end)):
                    chain = getattr(rt, attr)
                    if hasattr(chain, "add"):  # triton >= 3.5: a HookChain
                        chain.add(hook)
                    else:  # older: a single callable slot; keep whatever was there
                        prev = chain
                        setattr(rt, attr, _chained(prev, hook))
                _installed["triton"] = (rt, "", None)
                done.append("triton.knobs.runtime.kernel_load_start/end_hook")
    return done


def _chained(prev: Any, hook: Callable[..., None]) -> Callable[..., None]:
    def both(*args: Any, **kwargs: Any) -> None:
        if prev is not None:
            prev(*args, **kwargs)
        hook(*args, **kwargs)

    return both


def uninstall() -> None:
    with _lock:
        for key, (owner, name, orig) in list(_installed.items()):
            if key == "triton":
                for attr, hook in (("kernel_load_start_hook", _on_load_start), ("kernel_load_end_hook", _on_load_end)):
                    chain = getattr(owner, attr)
                    if hasattr(chain, "remove"):
                        try:
                            chain.remove(hook)
                        except ValueError:
                            pass
            else:
                setattr(owner, name, orig)
            del _installed[key]


def warm_up(*actions: Callable[[], Any]) -> None:
    """Run each action once with nothing of ours resident (first launches load their kernels), then sync."""
    with quiesced(eager=False):
        for a in actions:
            a()
        try:
            import torch

            if torch.cuda.is_available():
                orig = getattr(torch.cuda.synchronize, "__concordia_guarded__", torch.cuda.synchronize)
                orig()
        except ImportError:
            pass

