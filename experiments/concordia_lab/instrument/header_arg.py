"""The header's address as a kernel parameter (``SafepointOptions(header_arg=True)``): Triton's profile allocator.

Triton 3.6 passes every kernel two trailing pointers, global scratch and profile scratch. For a kernel whose
compiled metadata says ``profile_scratch_size > 0`` its launcher fills the second one on every launch with
``triton.runtime._allocation._profile_allocator(size, alignment, stream)``; only Proton sets that allocator.
``triton_hook`` gives each kernel it instruments with ``header_arg`` a size of ``HARG_SIZE`` and an alignment
that names the kernel (``route_of``: a tag no real profile-scratch request has, since it is no power of two,
and a checksum of the kernel's Triton hash), and installs the allocator below: for those kernels it returns the
header address of the call that armed that kernel (``None``, a null pointer, when none did: the probes then
read no memory at all), and it passes any other request to the allocator it replaced, so Proton keeps working
beside it. Calls that share no kernel can be armed at the same time, as with the constant-bank pointer.

A CUDA graph freezes the parameter when it is captured. An arena whose header went into a capture is therefore
kept for the life of the process (``pinned()``): the graph may be replayed after its ``ArmedLaunches`` is gone,
and its kernels would otherwise read freed memory as their header. A replay after disarming reads a header of
zeros, or finds at a pause that its kernel's ``cft_ctl_`` global names another arena, and runs.

Imports neither torch nor triton until it is used.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import InstrumentError

HARG_SIZE = 1  # bytes per block Triton multiplies by the grid for the request; the allocator ignores it
HARG_TAG = 0x43465401  # "CFT" 01 in an alignment's high 32 bits marks a request as ours (no power of two)


def route_of(kernel_hash: str) -> int:
    """The alignment a header_arg kernel's launcher passes to the profile allocator: our tag and the kernel."""
    return (HARG_TAG << 32) | zlib.crc32(kernel_hash.encode())


def is_route(alignment: int) -> bool:
    return alignment >> 32 == HARG_TAG


@dataclass
class _Route:
    header: int
    owner: Any  # the ArmedLaunches that armed the kernel (None: a PausableLaunch's own launch)
    keep: Any  # the tensor owning the header's memory
    captured: bool = False  # keep has been pinned by a graph capture


_lock = threading.Lock()
_routes: dict[int, _Route] = {}  # route_of(kernel) -> the call that armed it
_pinned: list[Any] = []  # arenas captured into CUDA graphs: kept for the process's life
_prev: Any = None  # the allocator ours replaced


def _alloc(size: int, alignment: int, stream: Any) -> Any:
    if not is_route(alignment):
        if _prev is None:
            raise RuntimeError("a kernel asked for profile scratch memory and no profiler's allocator is set")
        return _prev(size, alignment, stream)
    r = _routes.get(alignment)
    if r is None:
        return None
    if not r.captured:
        import torch  # noqa: TID251 - only while a header_arg kernel launches armed (torch is loaded then)

        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a torch built without CUDA: nothing is captured
            capturing = False
        if capturing:
            with _lock:
                if not _pinned_already(r.keep):
                    _pinned.append(r.keep)
                r.captured = True
    return r.header


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
    global _prev
    from triton.runtime import _allocation

    with _lock:
        _routes.clear()
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


def _pinned_already(keep: Any) -> bool:
    return any(p is keep for p in _pinned)


def activate(header: int, owner: Any, keep: Any, routes: dict[int, str]) -> None:
    """From now on every launch of the kernels in ``routes`` (``route_of`` -> kernel name) gets ``header``
    (an ``ArmedLaunches.arm()``). A kernel another armed call holds is refused: disarm that call first."""
    _require_installed()
    with _lock:
        for a, name in routes.items():
            r = _routes.get(a)
            if r is not None and r.owner is not owner:
                raise InstrumentError(f"{name} is armed by another call (header_arg routes a kernel's header "
                                      "parameter to one call at a time): disarm that call first")
        captured = _pinned_already(keep)
        for a in routes:
            _routes[a] = _Route(int(header), owner, keep, captured)


def deactivate(owner: Any) -> None:
    """Launches of ``owner``'s kernels after this get a null header (disarmed)."""
    with _lock:
        for a in [a for a, r in _routes.items() if r.owner is owner]:
            del _routes[a]


def header_for(route: int) -> int | None:
    """The header a launch of the kernel with this route gets now (None: disarmed)."""
    r = _routes.get(route)
    return None if r is None else r.header


@contextmanager
def using(header: int, keep: Any, route: int) -> Iterator[None]:
    """Launches of that kernel inside get ``header`` (a ``PausableLaunch``'s own launch); restored after."""
    _require_installed()
    with _lock:
        saved = _routes.get(route)
        _routes[route] = _Route(int(header), None, keep, _pinned_already(keep))
    try:
        yield
    finally:
        with _lock:
            if saved is None:
                _routes.pop(route, None)
            else:
                _routes[route] = saved


def pinned() -> int:
    """How many arenas are kept alive because a CUDA graph captured their header."""
    return len(_pinned)
