"""CPU CI: the profile allocator behind SafepointOptions(header_arg=True): it answers only requests whose alignment
carries its tag (anything else goes to the allocator it replaced, e.g. Proton's), gives each kernel the header
of the call that armed that kernel (null when none did), lets calls that share no kernel be armed together and
refuses a kernel armed twice, and restores what was there on uninstall."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton not installed")

from concordia_lab.errors import InstrumentError  # noqa: E402
from concordia_lab.instrument import header_arg  # noqa: E402


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


def test_each_kernel_gets_the_header_of_the_call_that_armed_it(profiler_allocator) -> None:
    from triton.runtime import _allocation

    a, b, c = (header_arg.route_of(h) for h in ("hash-a", "hash-b", "hash-c"))
    assert len({a, b, c}) == 3 and all(header_arg.is_route(r) for r in (a, b, c))
    assert not header_arg.is_route(128) and not header_arg.is_route(1 << 40)
    header_arg.install()
    header_arg.install()  # idempotent: it does not chain to itself
    alloc = _allocation._profile_allocator.get()
    assert alloc(4096, a, None) is None  # nothing armed: a null header, the probes read nothing
    x, y = object(), object()
    header_arg.activate(0xA000, x, object(), {a: "ka", b: "kb"})
    header_arg.activate(0xB000, y, object(), {c: "kc"})  # a call sharing no kernel: armed beside it
    try:
        assert (alloc(1, a, None), alloc(1, b, None), alloc(1, c, None)) == (0xA000, 0xA000, 0xB000)
        assert alloc(512, 128, None) == 0x7000_0000 + 512  # the profiler's own kernel
        assert profiler_allocator == [(512, 128)]
        with pytest.raises(InstrumentError, match="kb is armed by another call"):
            header_arg.activate(0xC000, object(), object(), {b: "kb"})
        assert alloc(1, b, None) == 0xA000  # the refused arming changed nothing
        with header_arg.using(0x123000, object(), b):  # one launch of a PausableLaunch
            assert alloc(1, b, None) == 0x123000 and alloc(1, a, None) == 0xA000
        assert alloc(1, b, None) == 0xA000
        header_arg.deactivate(object())  # not an owner: nothing changes
        assert header_arg.header_for(a) == 0xA000
    finally:
        header_arg.deactivate(x)
    assert (alloc(1, a, None), alloc(1, b, None), alloc(1, c, None)) == (None, None, 0xB000)
    header_arg.activate(0xD000, object(), object(), {b: "kb"})  # free again
    header_arg.uninstall()
    assert header_arg.header_for(b) is None and header_arg.header_for(c) is None  # uninstall forgets them
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
