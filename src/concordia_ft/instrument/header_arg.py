"""The header's address as a kernel parameter (``SafepointOptions(header_arg=True)``): Triton's profile allocator.

Triton 3.6 passes every kernel two trailing pointers, global scratch and profile scratch. For a kernel whose
compiled metadata says ``profile_scratch_size > 0`` its launcher fills the second one on every launch with
``triton.runtime._allocation._profile_allocator(size, alignment, stream)``; only Proton sets that allocator.
``triton_hook`` gives each kernel it instruments with ``header_arg`` a size of ``HARG_SIZE`` and the alignment
``HARG_ALIGN``, a value no real profile-scratch request has (it is not a power of two), and installs the
allocator below: for those kernels it returns the header address of the armed call (``None``, a null pointer,
when nothing is armed: the probes then read no memory at all), and it passes any other request to the allocator
it replaced, so Proton keeps working beside it.

A CUDA graph freezes the parameter when it is captured. An arena whose header went into a capture is therefore
kept for the life of the process (``pinned()``): the graph may be replayed after its ``ArmedLaunches`` is gone,
and its kernels would otherwise read freed memory as their header. A replay after disarming reads a header of
zeros, or finds at a pause that its kernel's ``cft_ctl_`` global names another arena, and runs.

Imports neither torch nor triton until it is used.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import InstrumentError

HARG_SIZE = 1  # bytes per block Triton multiplies by the grid for the request; the allocator ignores it
HARG_ALIGN = 0x43465401  # marks a request as ours ("CFT" 01); no power of two, so no profiler asks for it

_lock = threading.Lock()
_current: int | None = None  # the armed call's header address
_owner: Any = None  # what armed it (an ArmedLaunches); None while a PausableLaunch launches
_keep: Any = None  # the tensor that owns the header's memory
_captured = False  # _keep has been seen inside a graph capture (and pinned)
_pinned: list[Any] = []  # arenas captured into CUDA graphs: kept for the process's life
_prev: Any = None  # the allocator ours replaced


def _alloc(size: int, alignment: int, stream: Any) -> Any:
    global _captured
    if alignment != HARG_ALIGN:
        if _prev is None:
            raise RuntimeError("a kernel asked for profile scratch memory and no profiler's allocator is set")
        return _prev(size, alignment, stream)
    cur = _current
    if cur is not None and not _captured and _keep is not None:
        import torch  # noqa: TID251 - only while a header_arg kernel launches armed (torch is loaded then)

        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a torch built without CUDA: nothing is captured
            capturing = False
        if capturing:
            with _lock:
                _pinned.append(_keep)
                _captured = True
    return cur


def install() -> None:
    """Put our allocator in front of Triton's profile allocator (idempotent)."""
    global _prev
    from triton.runtime import _allocation

    with _lock:
        cur = _allocation._profile_allocator.get()
        if cur is _alloc:
            return
        _prev = None if cur is _allocation._NULL_ALLOCATOR else cur
        _allocation._profile_allocator.set(_alloc)


def uninstall() -> None:
    """Put back the allocator ours replaced; whatever was armed is forgotten (launches get no header)."""
    global _prev, _current, _owner, _keep
    from triton.runtime import _allocation

    with _lock:
        _current, _owner, _keep = None, None, None
        if _allocation._profile_allocator.get() is _alloc:
            _allocation._profile_allocator.set(_prev if _prev is not None else _allocation._NULL_ALLOCATOR)
        _prev = None


def installed() -> bool:
    from triton.runtime import _allocation

    return _allocation._profile_allocator.get() is _alloc


def _require_installed() -> None:
    if not installed():
        install()
    from triton.runtime import _allocation

    if _allocation._profile_allocator.get() is not _alloc:  # pragma: no cover - a race with another setter
        raise InstrumentError("Triton's profile allocator was replaced (by Proton?) after the safe-point hook "
                              "installed it: kernels built with header_arg would get no header; install the "
                              "profiler first, then triton_hook.install()")


def activate(header: int, owner: Any, keep: Any) -> None:
    """From now on every launch of a header_arg kernel gets ``header`` (an ``ArmedLaunches.arm()``)."""
    global _current, _owner, _keep, _captured
    _require_installed()
    with _lock:
        if _owner is not None and _owner is not owner:
            raise InstrumentError("another call is armed with header_arg kernels: disarm it first (the header "
                                  "parameter names one armed call per process at a time)")
        if _keep is not keep:
            _captured = any(p is keep for p in _pinned)
        _current, _owner, _keep = int(header), owner, keep


def deactivate(owner: Any) -> None:
    """Launches after this get a null header (disarmed), unless another owner armed since."""
    global _current, _owner, _keep
    with _lock:
        if _owner is owner:
            _current, _owner, _keep = None, None, None


def current() -> int | None:
    return _current


@contextmanager
def using(header: int, keep: Any) -> Iterator[None]:
    """Launches inside get ``header`` (a ``PausableLaunch``'s own launch); the state before is restored after."""
    global _current, _owner, _keep, _captured
    _require_installed()
    with _lock:
        saved = (_current, _owner, _keep, _captured)
        _current, _owner, _keep = int(header), None, keep
        _captured = any(p is keep for p in _pinned)
    try:
        yield
    finally:
        with _lock:
            _current, _owner, _keep, _captured = saved


def pinned() -> int:
    """How many arenas are kept alive because a CUDA graph captured their header."""
    return len(_pinned)
