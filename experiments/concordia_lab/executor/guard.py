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

Below both, when the CUPTI interposer runs in this process (``concordia_lab.instrument.interposer``: the driver
loaded it at ``cuInit`` through ``CUDA_INJECTION64_PATH``), the **native guard** steps every resident executor
aside from inside the driver, before any module or library load, a kernel's first launch (lazy loading),
``cuCtxSynchronize``, ``cuMemFree``/``cuMemFreeHost``, an unload or a graph instantiation, whoever makes the call
(cuBLAS, an eager kernel, cupy, Inductor's static launcher): ``native()`` finds it, executors register their
ring's stop/state words with it at their first launch, and ``install()`` then adds no Python hooks (the native
guard covers what they did; ``install(python_hooks=True)`` adds them anyway). instrument/DESIGN.md §4a.

Hooks resume lazily (the executor relaunches on its next submit), so the kernel that was just loaded gets its
first launch in before anything is resident again; ``quiesced()`` resumes eagerly unless told otherwise.

Exception safety: the depth always returns to what it was. ``enter`` that fails half-way resumes what it had
suspended; ``leave`` resumes every target even if one raises. Triton calls its start hook, loads, then its end
hook, with no ``finally``: a load that raises in between (out of resources, a driver error) never calls the end
hook. Each thread therefore remembers the load it opened; ``CompiledKernel._init_handles`` is wrapped so the
load is closed when that call ends either way, and (for Triton versions without that method) the next start
hook in the same thread closes a load left open before opening its own.
"""

from __future__ import annotations

import ctypes
import functools
import os
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


def depth() -> int:
    """How many quiesced regions are open (0: everything registered may run)."""
    return _depth


def enter() -> None:
    """Suspend everything registered (first entry only; nested entries count). If a suspend raises, what was
    suspended is resumed and the depth is back where it was before the error propagates."""
    global _depth
    with _lock:
        _depth += 1
        if _depth != 1:
            return
        stats["suspends"] += 1
        try:
            for t in targets():
                t.suspend()
                _suspended.append(t)
        except BaseException:
            _depth -= 1
            _resume_all(eager=True)
            raise


def leave(eager: bool = True) -> None:
    global _depth
    with _lock:
        if _depth == 0:
            raise RuntimeError("guard.leave() without enter()")
        _depth -= 1
        if _depth == 0:
            _resume_all(eager)


def _resume_all(eager: bool) -> None:
    """Resume every suspended target, newest first; the first error is raised after all were tried."""
    todo = list(reversed(_suspended))
    _suspended.clear()
    first: BaseException | None = None
    for t in todo:
        try:
            t.resume(eager)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others were resumed
            first = first or e
    if first is not None:
        raise first


@contextmanager
def quiesced(eager: bool = True) -> Iterator[None]:
    """Nothing of ours is resident or waiting on a flag inside this block: module loads, device-wide
    synchronize and cudaFree proceed. Tasks submitted meanwhile stay queued in the ring."""
    enter()
    try:
        yield
    finally:
        leave(eager)


class NativeGuard:
    """The interposer's guard (``_interposer.c``): rings registered here are stopped before every hazardous driver
    call of any thread and may run again when the last one returns. Driver-free: a store of the ring's stop word
    and a spin on its state word, both in host memory."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.cft_guard_add.restype = ctypes.c_int
        lib.cft_guard_add.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        lib.cft_guard_remove.restype = None
        lib.cft_guard_remove.argtypes = [ctypes.c_int]
        lib.cft_guard_depth.restype = ctypes.c_int
        lib.cft_guard_hold.restype = None
        lib.cft_guard_hold.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.cft_guard_set_timeout_ns.restype = None
        lib.cft_guard_set_timeout_ns.argtypes = [ctypes.c_uint64]
        lib.cft_guard_enter.restype = None
        lib.cft_guard_leave.restype = None
        self.depth = lib.cft_guard_depth  # a hazard call is open in some thread: relaunching would only stop again

    def add(self, stop_addr: int, state_addr: int) -> int:
        """Register a ring by the host addresses of its stop and state words; returns the handle."""
        h = int(self.lib.cft_guard_add(stop_addr, state_addr))
        if h < 0:
            from ..errors import ExecutorError

            raise ExecutorError("the native guard holds 64 executors already: close some before making more")
        return h

    def hold(self, handle: int, on: bool) -> None:
        """The executor's own stop request (suspend, warm-up) for a registered ring: the guard sets the stop word
        for hazards and, when they end, puts back this request instead of clearing it."""
        self.lib.cft_guard_hold(handle, int(on))

    def remove(self, handle: int) -> None:
        self.lib.cft_guard_remove(handle)

    def set_timeout(self, seconds: float) -> None:
        """How long a hazard waits for a block to leave before it proceeds anyway (counted in ``timeouts``)."""
        self.lib.cft_guard_set_timeout_ns(int(seconds * 1e9))

    def stats(self) -> dict[str, Any]:
        from ..instrument import interposer

        return dict(interposer.snapshot(self.lib)["guard"])


_native: NativeGuard | None = None
_native_checked = False


def native(*, recheck: bool = False) -> NativeGuard | None:
    """The native guard, when the driver loaded the interposer into this process and it subscribed (else None).
    Looked up once: call after CUDA is initialised (executors do, at their first launch)."""
    global _native, _native_checked
    with _lock:
        if _native_checked and not recheck:
            return _native
        _native_checked = True
        _native = None
        path = os.environ.get("CUDA_INJECTION64_PATH", "")
        if os.path.basename(path) != "libconcordia_interposer.so":
            return None
        try:  # only the copy the driver loaded: never load it here
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            return None
        lib.cft_snapshot.restype = ctypes.c_size_t
        lib.cft_snapshot.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        if not hasattr(lib, "cft_guard_add"):  # an interposer built before the guard existed
            return None
        g = NativeGuard(lib)
        from ..instrument import interposer

        if not interposer.snapshot(lib).get("started"):
            return None
        _native = g
        return g


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


_tls = threading.local()  # .open_load: this thread's Triton load is between its start and end hooks


def _open_load() -> bool:
    return bool(getattr(_tls, "open_load", False))


def _close_open_load() -> None:
    """Close this thread's Triton load if it is still open (its end hook never ran: the load raised)."""
    if _open_load():
        _tls.open_load = False
        leave(eager=False)


def _on_load_start(*args: Any, **kwargs: Any) -> None:
    stats["hook_calls"] += 1
    _close_open_load()  # loads do not nest in a thread: one still open here raised between its hooks
    enter()
    _tls.open_load = True


def _on_load_end(*args: Any, **kwargs: Any) -> None:
    _close_open_load()  # nothing open (hooks installed mid-load): nothing to leave


def _closing_open_load(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``CompiledKernel._init_handles``: whatever it raises, the load its start hook opened is closed."""

    @functools.wraps(fn)
    def init_handles(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "module", None) is not None:  # every launch calls it; loaded already: nothing to guard
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        finally:
            _close_open_load()

    init_handles.__concordia_guarded__ = fn  # type: ignore[attr-defined]
    return init_handles


def install(*, torch_hooks: bool = True, triton_hooks: bool = True, python_hooks: bool | None = None) -> list[str]:
    """Install the hooks (idempotent); returns what was hooked. With the native guard running in this process
    (``native()``) the Python hooks are left out unless ``python_hooks=True``: it covers every call they did."""
    done: list[str] = []
    if python_hooks is None and native() is not None:
        return ["native guard (CUPTI interposer)"]
    if python_hooks is False:
        return done
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
                ck = _compiled_kernel_class()
                if ck is not None and getattr(ck._init_handles, "__concordia_guarded__", None) is None:
                    _installed["triton.CompiledKernel._init_handles"] = (ck, "_init_handles", ck._init_handles)
                    ck._init_handles = _closing_open_load(ck._init_handles)
                    done.append("triton.compiler.CompiledKernel._init_handles")
    return done


def _compiled_kernel_class() -> Any:
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        return None
    return CompiledKernel if callable(getattr(CompiledKernel, "_init_handles", None)) else None


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

