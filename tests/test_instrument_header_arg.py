"""CPU CI: the profile allocator behind SafepointOptions(header_arg=True): it answers only requests that carry its
marker alignment (anything else goes to the allocator it replaced, e.g. Proton's), gives the armed call's header
(null when nothing is armed), lets one call be armed at a time, and restores what was there on uninstall."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton not installed")

from concordia_ft.errors import InstrumentError  # noqa: E402
from concordia_ft.instrument import header_arg  # noqa: E402


@pytest.fixture
def profiler_allocator():
    """A profiler's allocator set before ours, as Proton sets one: it records what it was asked for."""
    from triton.runtime import _allocation

    asked: list[tuple[int, int]] = []

    def proton_like(size: int, alignment: int, stream: object) -> int:
        asked.append((size, alignment))
        return 0x7000_0000 + size

    saved = _allocation._profile_allocator.get()
    _allocation._profile_allocator.set(proton_like)
    try:
        yield asked
    finally:
        header_arg.uninstall()
        _allocation._profile_allocator.set(saved)


def test_marked_requests_get_the_armed_header_and_others_go_to_the_profiler(profiler_allocator) -> None:
    from triton.runtime import _allocation

    header_arg.install()
    header_arg.install()  # idempotent: it does not chain to itself
    alloc = _allocation._profile_allocator.get()
    assert alloc(4096, header_arg.HARG_ALIGN, None) is None
    owner, keep = object(), object()
    header_arg.activate(0xABC000, owner, keep)
    try:
        assert alloc(4096, header_arg.HARG_ALIGN, None) == 0xABC000
        assert alloc(512, 128, None) == 0x7000_0000 + 512  # the profiler's own kernel
        assert profiler_allocator == [(512, 128)]
        with pytest.raises(InstrumentError, match="another call is armed"):
            header_arg.activate(0xDEF000, object(), object())
        with header_arg.using(0x123000, object()):  # one launch of a PausableLaunch
            assert alloc(1, header_arg.HARG_ALIGN, None) == 0x123000
        assert alloc(1, header_arg.HARG_ALIGN, None) == 0xABC000
        header_arg.deactivate(object())  # not the owner: nothing changes
        assert header_arg.current() == 0xABC000
    finally:
        header_arg.deactivate(owner)
    assert alloc(1, header_arg.HARG_ALIGN, None) is None
    header_arg.activate(0xDEF000, object(), object())  # free again
    header_arg.uninstall()
    assert header_arg.current() is None  # uninstall forgets what was armed
    assert _allocation._profile_allocator.get() is not alloc
    assert _allocation._profile_allocator.get()(8, 16, None) == 0x7000_0000 + 8  # the profiler's is back


def test_an_unmarked_request_without_a_profiler_says_so() -> None:
    from triton.runtime import _allocation

    saved = _allocation._profile_allocator.get()
    _allocation._profile_allocator.set(_allocation._NULL_ALLOCATOR)
    try:
        header_arg.install()
        with pytest.raises(RuntimeError, match="no profiler"):
            _allocation._profile_allocator.get()(8, 16, None)
    finally:
        header_arg.uninstall()
        _allocation._profile_allocator.set(saved)
