"""GPU: an Inductor-compiled function, compiled while the safe-point hook is installed, armed through
instrument/inductor.py, paused mid-grid by the GPU and resumed by calling the compiled function again: the
output is bit-equal to the uninterrupted call, and after the pause exactly the pending blocks' elements are
unwritten."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from concordia_lab.instrument import SafepointOptions, triton_hook  # noqa: E402

# probe options under test beside the defaults (e.g. '{"late_reads": true}')
EXTRA = json.loads(os.environ.get("CFT_TEST_SAFEPOINT_OPTIONS", "{}"))
# "0": the pause trigger does not gate the launch's stream (GpuPauseTrigger.arm(gate=None)), to compare
GATE = None if os.environ.get("CFT_TEST_TRIGGER_GATE") == "0" else "current"
THREADS = int(os.environ.get("CFT_TEST_TRIGGER_THREADS", "1024"))


def _silu_mul_add(x, w, out):
    out.copy_(x * torch.sigmoid(x) * w + 1.0)  # Inductor writes the mutated input from its one kernel


def _compiling(fn, options: SafepointOptions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``fn`` compiled by Inductor in-process (the stages hook sees the compile) with the hook installed."""
    import torch._dynamo
    import torch._inductor.config as icfg

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(icfg, "compile_threads", 1)
    monkeypatch.setattr(icfg, "fx_graph_cache", False)
    torch._dynamo.reset()
    triton_hook.install(options, cache_dir=tmp_path / "triton")
    try:
        yield torch.compile(fn, dynamic=False)
    finally:
        triton_hook.uninstall()
        torch._dynamo.reset()


@pytest.fixture
def compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from _compiling(_silu_mul_add, SafepointOptions(**EXTRA), tmp_path, monkeypatch)


def test_an_inductor_function_pauses_mid_grid_and_resumes_bit_equal(compiled) -> None:
    # every call under no_grad, as capture_launches makes its call: grad mode is one of Dynamo's guards, and a
    # call in the other mode recompiles (batch 1: the capture then recorded the new graph's autotuning, 213
    # launches)
    with torch.no_grad():
        _paused_and_resumed(compiled)


def _paused_and_resumed(compiled) -> None:
    from concordia_ft.cuda import driver as cd
    from concordia_lab.instrument.inductor import ArmedLaunches, capture_launches
    from concordia_lab.instrument.pause import GpuPauseTrigger

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8192, 4096, device="cuda", generator=g)
    w = torch.randn(4096, device="cuda", generator=g)
    out = torch.full_like(x, float("nan"))
    compiled(x, w, out)
    torch.testing.assert_close(out, x * torch.sigmoid(x) * w + 1.0)
    compiled(x, w, out)
    launches = capture_launches(compiled, (x, w, out))
    assert len(launches) == 1, [k.name for k in launches]
    (k,) = launches
    rep = triton_hook.report(k.name)
    assert rep is not None and rep.instrumented, rep
    armed = ArmedLaunches(launches)
    assert armed.with_probes == [k.name] and not armed.skipped
    view = armed.view(0)
    # the uninterrupted reference: disarmed, then armed (every block done)
    out.fill_(float("nan"))
    compiled(x, w, out)
    want = out.clone()
    armed.arm()
    armed.reset()
    out.fill_(float("nan"))
    compiled(x, w, out)
    assert torch.equal(out, want) and armed.done_counts() == [k.nblocks]
    xblock = int(k.autotuner.launchers[0].config.kwargs.get("XBLOCK", 0))
    trigger = GpuPauseTrigger()
    side = torch.cuda.Stream()
    assert k.nblocks > 8 * cd.sm_count()  # several waves: a pause at a block count lands mid-grid
    for frac in (0.25, 0.5, 0.75):
        after = int(frac * k.nblocks)
        out.fill_(float("nan"))
        armed.reset()
        zeroed = torch.cuda.Event()
        zeroed.record()
        side.wait_event(zeroed)  # the trigger must not count the previous call's done bits / outputs
        trigger.arm(view, after, cd.Stream.borrow(side.cuda_stream), watch=out if armed.protocol == 5 else None,
                    words_per_block=xblock, gate=GATE, threads=THREADS)
        compiled(x, w, out)
        torch.cuda.synchronize()
        res = trigger.result()
        pend = view.pending()
        assert res["reached"] == 1 and res["done_seen"] >= after, res
        assert 0 < len(pend) < k.nblocks, (frac, len(pend), res)  # mid-grid
        if res["sample_step"] == 1:  # protocol 4's exact count (5 samples the output)
            assert len(pend) <= k.nblocks - after, (frac, len(pend), res)
        if xblock and k.grid[1] == k.grid[2] == 1 and out.numel() == xblock * k.nblocks:
            unwritten = torch.isnan(out.view(k.nblocks, xblock))
            blocks_nan = unwritten.all(dim=1)
            assert torch.equal(blocks_nan, unwritten.any(dim=1))  # a block wrote all of its elements or none
            assert torch.nonzero(blocks_nan).flatten().tolist() == pend  # exactly the pending ones are unwritten
        if armed.protocol == 5:
            armed.begin_resume()
            compiled(x, w, out)  # resume mode: only the skipped blocks run
            torch.cuda.synchronize()
            assert armed.end_resume() == 0
        else:
            view.set_pause(False)
            compiled(x, w, out)  # armed, not reset: the resume (done blocks leave at entry)
            torch.cuda.synchronize()
        assert view.pending() == [] and torch.equal(out, want)
    if armed.protocol == 5:  # armed, not paused: an armed call leaves the records zero, no reset needed
        out.fill_(float("nan"))
        compiled(x, w, out)
        assert torch.equal(out, want) and armed.done_counts() == [k.nblocks]
    armed.disarm()


def _layer(x, w, out):
    out.copy_(torch.tanh(x * w) * 0.5 + x)  # one pointwise kernel, reused by every "layer" of the stack


@pytest.fixture
def compiled_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from _compiling(_layer, SafepointOptions(**EXTRA), tmp_path, monkeypatch)


def test_a_stack_reusing_one_kernel_pauses_twice_and_resumes_bit_equal(compiled_layer) -> None:
    """Protocol 5: five launches of one compiled kernel (a stack of layers through one graph) share one control
    region; paused inside layer 2, then paused again inside layer 4 while resuming, then resumed to the end:
    bit-equal to the uninterrupted stack, every (layer, block) exactly once."""
    from concordia_ft.cuda import driver as cd
    from concordia_lab.instrument.inductor import ArmedLaunches, capture_launches
    from concordia_lab.instrument.pause import GpuPauseTrigger

    if SafepointOptions(**EXTRA).protocol != 5:
        pytest.skip("the stack test is protocol 5's (protocol 4 arms a repeated kernel per launch)")
    nl = 5
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(8192, 2048, device="cuda", generator=g)
    ws = [torch.randn(2048, device="cuda", generator=g) for _ in range(nl)]
    bufs = [x] + [torch.full_like(x, float("nan")) for _ in range(nl)]

    def stack() -> None:
        for i in range(nl):
            compiled_layer(bufs[i], ws[i], bufs[i + 1])

    with torch.no_grad():
        stack()
        stack()
        ref = x.double()
        for i in range(nl):
            ref = torch.tanh(ref * ws[i].double()) * 0.5 + ref
        torch.testing.assert_close(bufs[-1].double(), ref, rtol=1e-4, atol=1e-4)
        want = [b.clone() for b in bufs[1:]]
        launches = capture_launches(stack, ())
    assert len(launches) == nl and len({k.function for k in launches}) == 1, [k.name for k in launches]
    armed = ArmedLaunches(launches)
    assert armed.protocol == 5
    armed.arm()
    k = launches[0]
    xblock = int(k.autotuner.launchers[0].config.kwargs.get("XBLOCK", 0))
    assert xblock and k.grid[1] == k.grid[2] == 1 and x.numel() == xblock * k.nblocks
    assert k.nblocks > 8 * cd.sm_count()
    trigger = GpuPauseTrigger()
    side = torch.cuda.Stream()

    def paused_at(layer: int, frac: float) -> None:
        zeroed = torch.cuda.Event()
        zeroed.record()
        side.wait_event(zeroed)
        trigger.arm(armed.view(layer), int(frac * k.nblocks), cd.Stream.borrow(side.cuda_stream),
                    watch=bufs[layer + 1], words_per_block=xblock, gate=GATE, threads=THREADS)

    def check_pending() -> list[list[int]]:
        pend = armed.pending()
        for i, p in enumerate(pend):
            nan = torch.isnan(bufs[i + 1].view(k.nblocks, xblock))
            blocks_nan = nan.all(dim=1)
            assert torch.equal(blocks_nan, nan.any(dim=1))
            assert torch.nonzero(blocks_nan).flatten().tolist() == p, (i, len(p))
            if not p:
                assert torch.equal(bufs[i + 1], want[i]), i
        return pend

    with torch.no_grad():
        for b in bufs[1:]:
            b.fill_(float("nan"))
        paused_at(1, 0.5)
        stack()
        torch.cuda.synchronize()
        assert trigger.result()["reached"] == 1
        pend = check_pending()
        assert pend[0] == [] and 0 < len(pend[1]) < k.nblocks, [len(p) for p in pend]
        assert all(len(p) == k.nblocks for p in pend[2:])  # the pause is sticky: later layers skipped whole
        armed.begin_resume()
        paused_at(3, 0.5)  # paused again while resuming, inside layer 4
        stack()
        torch.cuda.synchronize()
        assert trigger.result()["reached"] == 1
        pend = check_pending()
        assert pend[:3] == [[], [], []] and 0 < len(pend[3]) < k.nblocks and len(pend[4]) == k.nblocks
        assert armed.end_resume() > 0
        armed.begin_resume()
        stack()
        torch.cuda.synchronize()
        assert armed.end_resume() == 0
        assert check_pending() == [[]] * nl
        for i in range(nl):
            assert torch.equal(bufs[i + 1], want[i]), f"layer {i}: resumed output differs"
        # armed and not paused again: a plain call, bit-equal, nothing recorded
        for b in bufs[1:]:
            b.fill_(float("nan"))
        stack()
        assert armed.done_counts() == [k.nblocks] * nl and torch.equal(bufs[-1], want[-1])
        # paused from the host through the side stream before the call: every launch skipped whole
        armed.request_pause()
        torch.cuda.synchronize()
        for b in bufs[1:]:
            b.fill_(float("nan"))
        stack()
        assert [len(p) for p in check_pending()] == [k.nblocks] * nl
        armed.begin_resume()
        stack()
        assert armed.end_resume() == 0
        assert all(torch.equal(bufs[i + 1], want[i]) for i in range(nl))
    armed.disarm()


@pytest.fixture
def compiled_harg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield from _compiling(_silu_mul_add, SafepointOptions(header_arg=True), tmp_path, monkeypatch)


def test_header_arg_graphs_disarmed_run_plain_and_armed_graphs_pause_and_resume_bit_equal(compiled_harg) -> None:
    """SafepointOptions(header_arg=True): the header's address reaches the kernel through Triton's launcher.
    A CUDA graph captured disarmed got a null header and runs plain even while the call is armed later; a graph
    captured armed froze this call's header (its arena is pinned), so a pause set before a replay skips every
    block, and the resume replay runs exactly those: bit-equal to the uninterrupted call."""
    from concordia_lab.instrument import header_arg
    from concordia_lab.instrument.inductor import ArmedLaunches, capture_launches

    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(4096, 4096, device="cuda", generator=g)
    w = torch.randn(4096, device="cuda", generator=g)
    out = torch.full_like(x, float("nan"))
    with torch.no_grad():
        compiled_harg(x, w, out)
        compiled_harg(x, w, out)
        want = out.clone()
        torch.testing.assert_close(want, x * torch.sigmoid(x) * w + 1.0)
        launches = capture_launches(compiled_harg, (x, w, out))
        assert len(launches) == 1 and not launches[0].static  # Triton's launcher fills the parameter
        armed = ArmedLaunches(launches)
        assert armed.protocol == 5 and armed.header_arg and armed.with_probes == [launches[0].name]
        n = launches[0].nblocks

        def graph() -> torch.cuda.CUDAGraph:
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                compiled_harg(x, w, out)
            torch.cuda.synchronize()
            return gr

        plain_graph = graph()  # disarmed: a null header frozen in
        pinned = header_arg.pinned()
        armed.arm()
        armed_graph = graph()
        assert header_arg.pinned() == pinned + 1  # the captured header's arena outlives the graph
        # eager, armed and paused: every block skipped
        armed.set_pause(True)
        out.fill_(float("nan"))
        compiled_harg(x, w, out)
        assert len(armed.pending()[0]) == n and torch.isnan(out).all()
        armed.begin_resume()
        compiled_harg(x, w, out)
        torch.cuda.synchronize()
        assert armed.end_resume() == 0 and torch.equal(out, want)
        # the disarmed graph ignores the armed call's pause
        armed.set_pause(True)
        out.fill_(float("nan"))
        plain_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and armed.pending() == [[]]
        # the armed graph sees it, and resumes
        out.fill_(float("nan"))
        armed_graph.replay()
        torch.cuda.synchronize()
        assert len(armed.pending()[0]) == n and torch.isnan(out).all()
        armed.begin_resume()
        armed_graph.replay()
        torch.cuda.synchronize()
        assert armed.end_resume() == 0 and torch.equal(out, want)
        # disarmed: eager launches get no header again; the armed graph still replays correctly (header zero)
        armed.disarm()
        assert header_arg.header_for(next(iter(armed._routes))) is None
        out.fill_(float("nan"))
        armed_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
