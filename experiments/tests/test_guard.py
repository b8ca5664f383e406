"""The hazard guard's bookkeeping on CPU: the depth returns to 0 whatever raises.

The Triton tests run Triton's real ``CompiledKernel._init_handles`` with the real hook chain of
``triton.knobs``; only the GPU driver under it is replaced (this machine has none), and that replacement raises
exactly where a real load fails: in ``load_binary``, or in the resource check right after it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest

from concordia_lab.executor import guard


class RecordingTarget:
    """A Suspendable that records what the guard asked of it (optionally failing on suspend)."""

    kind = "resident"

    def __init__(self, fail_suspend: bool = False) -> None:
        self.events: list[str] = []
        self.fail_suspend = fail_suspend
        self.suspended = False

    def suspend(self) -> None:
        if self.fail_suspend:
            raise RuntimeError("suspend failed")
        self.suspended = True
        self.events.append("suspend")

    def resume(self, eager: bool = True) -> None:
        self.suspended = False
        self.events.append("resume")


@pytest.fixture
def target() -> Any:
    assert guard.depth() == 0
    t = RecordingTarget()
    guard.register(t)
    yield t
    guard.unregister(t)
    assert guard.depth() == 0


def test_quiesced_restores_depth_when_the_body_raises(target: RecordingTarget) -> None:
    with pytest.raises(ValueError), guard.quiesced():
        assert guard.depth() == 1 and target.suspended
        raise ValueError("inside")
    assert guard.depth() == 0 and not target.suspended


def test_a_failing_suspend_leaves_depth_zero_and_resumes_the_others(target: RecordingTarget) -> None:
    bad = RecordingTarget(fail_suspend=True)
    bad.kind = "armed"  # suspended after the resident one
    guard.register(bad)
    try:
        with pytest.raises(RuntimeError, match="suspend failed"), guard.quiesced():
            pass
        assert guard.depth() == 0
        assert target.events == ["suspend", "resume"] and not target.suspended
    finally:
        guard.unregister(bad)


def test_a_failing_resume_still_resumes_everyone(target: RecordingTarget) -> None:
    class BadResume(RecordingTarget):
        def resume(self, eager: bool = True) -> None:
            super().resume(eager)
            raise RuntimeError("resume failed")

    bad = BadResume()
    guard.register(bad)
    try:
        with pytest.raises(RuntimeError, match="resume failed"), guard.quiesced():
            pass
        assert guard.depth() == 0 and not target.suspended and not bad.suspended
    finally:
        guard.unregister(bad)


# ------------------------------------------------------------------------------------------------ triton
triton_compiler = pytest.importorskip("triton.compiler.compiler", reason="triton not installed")
from triton import knobs  # noqa: E402

Meta = collections.namedtuple("Meta", "shared num_warps tmem_size")


class FailingDriver:
    """What ``triton.runtime.driver`` would be on a GPU, down to the load, which fails as asked."""

    def __init__(self, fail: str, seen_depth: list[int]) -> None:
        self.fail = fail
        self.seen_depth = seen_depth
        outer = self

        class Utils:
            def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[Any, ...]:
                outer.seen_depth.append(guard.depth())  # the load runs with everything suspended
                if outer.fail == "load":
                    raise RuntimeError("Triton Error [CUDA]: out of memory")
                n_max_threads = 32 if outer.fail == "threads" else 1024
                return object(), object(), 32, 0, n_max_threads

        class Target:
            warp_size = 32

        class Active:
            utils = Utils()

            def get_current_device(self) -> int:
                return 0

            def launcher_cls(self, src: Any, metadata: Any) -> Any:
                return lambda *a: None

            def get_current_target(self) -> Any:
                return Target()

        self.active = Active()


def _kernel() -> Any:
    k = triton_compiler.CompiledKernel.__new__(triton_compiler.CompiledKernel)
    k.module = k.function = k._run = None
    k.src, k.name, k.kernel, k.metadata_group, k.hash = None, "concordia_test_kernel", b"", {}, "0" * 64
    k.metadata = Meta(shared=0, num_warps=4, tmem_size=None)
    return k


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(triton_compiler, "max_shared_mem", lambda device: 228 * 1024)
    done = guard.install(torch_hooks=False, triton_hooks=True)
    assert "triton.knobs.runtime.kernel_load_start/end_hook" in done
    yield done
    guard.uninstall()
    assert getattr(triton_compiler.CompiledKernel._init_handles, "__concordia_guarded__", None) is None


@pytest.mark.parametrize("fail", ["load", "threads"])
def test_a_triton_load_that_raises_between_its_hooks_leaves_depth_zero(
        target: RecordingTarget, hooked: Any, monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    seen: list[int] = []
    monkeypatch.setattr(triton_compiler, "driver", FailingDriver(fail, seen))
    with pytest.raises((RuntimeError, triton_compiler.OutOfResources)):
        _kernel()._init_handles()
    assert seen == [1]  # the start hook ran: the load happened quiesced
    assert guard.depth() == 0 and not target.suspended, "the failed load left the guard entered"
    # and the next load, a good one, is bracketed and closed normally
    monkeypatch.setattr(triton_compiler, "driver", FailingDriver("none", seen))
    k = _kernel()
    k._init_handles()
    assert k.module is not None and seen == [1, 1] and guard.depth() == 0 and not target.suspended


def test_without_the_wrapper_the_next_start_hook_closes_a_load_left_open(target: RecordingTarget,
                                                                         hooked: Any) -> None:
    # a Triton without CompiledKernel._init_handles: only its hooks reach us
    knobs.runtime.kernel_load_start_hook(None, None, "k1", {}, "h1")
    assert guard.depth() == 1  # k1's load raised: no end hook
    knobs.runtime.kernel_load_start_hook(None, None, "k2", {}, "h2")
    assert guard.depth() == 1
    knobs.runtime.kernel_load_end_hook(None, None, "k2", {}, "h2")
    assert guard.depth() == 0 and not target.suspended
    knobs.runtime.kernel_load_end_hook(None, None, "k3", {}, "h3")  # an end without a start is ignored
    assert guard.depth() == 0


def test_loads_in_two_threads_each_close_their_own(target: RecordingTarget, hooked: Any) -> None:
    started, release = threading.Barrier(2), threading.Event()

    def load(name: str) -> None:
        knobs.runtime.kernel_load_start_hook(None, None, name, {}, name)
        started.wait()
        release.wait()
        knobs.runtime.kernel_load_end_hook(None, None, name, {}, name)

    threads = [threading.Thread(target=load, args=(f"k{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    while guard.depth() < 2:
        pass
    assert target.suspended
    release.set()
    for t in threads:
        t.join()
    assert guard.depth() == 0 and not target.suspended and target.events == ["suspend", "resume"]
