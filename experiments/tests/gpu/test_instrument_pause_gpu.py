"""GPU: Triton kernels compiled with safe points pause by blocks and resume bit-equal (matmul, softmax,
layernorm, an atomic sum), and a paused launch finishes in a fresh process from its Runtime epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from concordia_lab.instrument import SafepointOptions, triton_hook  # noqa: E402
from concordia_lab.instrument.pause import PausableLaunch  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import instrument_kernels as ik  # noqa: E402

# probe options under test beside the defaults (e.g. '{"late_reads": true}'): the same GPU tests for a variant
EXTRA = json.loads(os.environ.get("CFT_TEST_SAFEPOINT_OPTIONS", "{}"))
# "0": the pause trigger does not gate the launch's stream (GpuPauseTrigger.arm(gate=None)), to compare
GATE = None if os.environ.get("CFT_TEST_TRIGGER_GATE") == "0" else "current"
THREADS = int(os.environ.get("CFT_TEST_TRIGGER_THREADS", "1024"))


@pytest.fixture(autouse=True)
def _hook(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    barriers = bool(getattr(request, "param", False))
    # protocol 5's options do not apply to protocol 4's barrier probes
    v4 = {k: v for k, v in EXTRA.items() if k not in ("const_ctl", "entry_header", "early_header", "header_arg",
                                                      "stmatrix_sync", "cold_path", "warp_vote")}
    opts = {**v4, "barrier_probes": True, "protocol": 4} if barriers else EXTRA  # barrier probes: v4 only
    triton_hook.install(SafepointOptions(**opts), cache_dir=tmp_path_factory.mktemp("tcache"))
    yield
    triton_hook.uninstall()


def fresh(fn):
    """A JITFunction with its own in-memory cache (compiled under whatever hook is installed now)."""
    return triton.JITFunction(fn.fn)


def _matmul_case(n: int):
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=g)
    c = torch.full((n, n), float("nan"), device="cuda", dtype=torch.float32)
    grid = (triton.cdiv(n, 128), triton.cdiv(n, 128))
    args = [a, b, c, n, n, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1)]
    kw = dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
    ref = (a.double() @ b.double())
    return ik.matmul_kernel, grid, args, kw, c, ref


def _softmax_case(rows: int, cols: int = 1000):
    x = torch.randn(rows, cols, device="cuda")
    y = torch.full_like(x, float("nan"))
    return ik.softmax_kernel, (rows,), [x, y, cols, x.stride(0)], dict(BLOCK=1024), y, torch.softmax(x.double(), 1)


def _layernorm_case(rows: int, cols: int = 3000):
    x = torch.randn(rows, cols, device="cuda")
    w = torch.randn(cols, device="cuda")
    b = torch.randn(cols, device="cuda")
    y = torch.full_like(x, float("nan"))
    ref = torch.nn.functional.layer_norm(x.double(), (cols,), w.double(), b.double(), 1e-5)
    return ik.layernorm_kernel, (rows,), [x, y, w, b, cols, x.stride(0), 1e-5], dict(BLOCK=512), y, ref


def x_cols(args: list) -> int:
    return int(args[0].stride(0))  # 32-bit words between two rows' first elements (fp32)


CASES = {"matmul": lambda: _matmul_case(8192), "softmax": lambda: _softmax_case(262144),
         "layernorm": lambda: _layernorm_case(131072)}


def _uninterrupted(fn, grid, args, kw, out):
    """The output of the kernel compiled WITHOUT probes (what the user would run), and its run time."""
    with triton_hook.suspended():
        plain = fresh(fn)
        plain[grid](*args, **kw)  # compile + warm
        out.fill_(float("nan"))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        plain[grid](*args, **kw)
        e1.record()
        torch.cuda.synchronize()
    return out.clone(), e0.elapsed_time(e1) / 1e3


@pytest.mark.parametrize("name,_hook", [("matmul", False), ("softmax", False), ("layernorm", False),
                                        ("softmax", True), ("layernorm", True)],
                         indirect=["_hook"], ids=["matmul", "softmax", "layernorm", "softmax-barriers",
                                                  "layernorm-barriers"])
def test_pause_mid_kernel_then_resume_is_bit_equal(name: str, _hook: None) -> None:
    fn, grid, args, kw, out, ref = CASES[name]()
    want, run_s = _uninterrupted(fn, grid, args, kw, out)
    rel = ((want.double() - ref).norm() / ref.norm()).item()
    assert rel < (1e-2 if name == "matmul" else 1e-5), rel
    jf = fresh(fn)
    launch = PausableLaunch(jf, grid, args, kw)
    seen_partial = False
    for delay_s in (0.0, 0.15 * run_s, 0.4 * run_s, 0.7 * run_s):
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        launch.start()
        t_end = time.perf_counter() + delay_s
        while time.perf_counter() < t_end:
            pass
        st = launch.pause()
        pend = launch.pending()
        assert st.pending_blocks == len(pend) == launch.nblocks - st.done_blocks
        if 0 < len(pend) < launch.nblocks:
            seen_partial = True
            assert torch.isnan(out).any()  # the paused blocks really did not run
        launch.resume()
        launch.drain()
        assert launch.pending() == []
        assert torch.equal(out, want), f"{name}: resumed output differs from the uninterrupted launch"
    assert seen_partial, "no pause landed mid-kernel: make the kernel longer"


def test_pause_before_start_defers_every_block_and_atomics_stay_exactly_once() -> None:
    n = 1 << 22
    x = torch.randn(n, device="cuda")
    out = torch.zeros(1, device="cuda")
    jf = fresh(ik.atomic_sum_kernel)
    launch = PausableLaunch(jf, (n // 1024,), [x, out, n], dict(BLOCK=1024))
    launch.ctl.zero_()
    launch.ctl[0] = 1  # paused before any block starts
    launch._launch()
    launch.drain()
    assert launch.pending() == list(range(n // 1024)) and out.item() == 0.0
    launch.resume()
    launch.drain()
    assert launch.pending() == []
    assert abs(out.item() - x.double().sum().item()) < 1e-2 * max(1.0, abs(x.double().sum().item())) + 1.0
    launch.disarm()  # disarmed: the instrumented kernel behaves as the original
    out.zero_()
    jf[(n // 1024,)](x, out, n, BLOCK=1024)
    torch.cuda.synchronize()
    assert abs(out.item() - x.double().sum().item()) < 5.0


def test_paused_launch_finishes_in_a_fresh_process(tmp_path: Path) -> None:
    from concordia_ft.runtime import Runtime

    fn, grid, args, kw, out, _ = _matmul_case(2048)
    want, _ = _uninterrupted(fn, grid, args, kw, out)
    out.fill_(float("nan"))
    launch = PausableLaunch(fresh(fn), grid, args, kw)
    launch.ctl.zero_()
    # pause a deterministic half: the first launch runs with the flag clear, then a second pause
    launch.start()
    launch.pause()
    if not launch.pending():  # the whole grid finished before the flag landed: defer all blocks instead
        out.fill_(float("nan"))
        launch.ctl.zero_()
        launch.ctl[0] = 1
        launch._launch()
        launch.drain()
    assert launch.pending()
    rt = Runtime(tmp_path / "log", fsync="always")
    launch.checkpoint(rt)
    rt.close()
    torch.save(want.cpu(), tmp_path / "want.pt")
    code = (
        "import sys, torch; sys.path.insert(0, {!r})\n"
        "from concordia_lab.instrument import triton_hook, SafepointOptions\n"
        "triton_hook.install(SafepointOptions(**{!r}), cache_dir={!r})\n"
        "from concordia_lab.instrument.pause import finish_from_log\n"
        "t = finish_from_log({!r})\n"
        "want = torch.load({!r})\n"
        "got = t['paused.arg2'].cpu()\n"
        "print('BITEQ', torch.equal(got, want))\n"
    ).format(str(TESTS), EXTRA, str(tmp_path / "tc2"), str(tmp_path / "log"), str(tmp_path / "want.pt"))
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "BITEQ True" in r.stdout, r.stdout + r.stderr


def test_a_pause_written_by_the_gpu_at_a_block_count_lands_mid_grid_every_time() -> None:
    """GpuPauseTrigger: the pause word is written from the GPU once half of the blocks finished, so every
    trial pauses mid-grid (no host timer), with at least that many blocks done; resume is bit-equal."""
    from concordia_ft.cuda import driver as cd
    from concordia_lab.instrument.pause import GpuPauseTrigger

    fn, grid, args, kw, out, _ = _softmax_case(262144)
    want, _ = _uninterrupted(fn, grid, args, kw, out)
    launch = PausableLaunch(fresh(fn), grid, args, kw)
    trigger = GpuPauseTrigger()
    side = torch.cuda.Stream()
    for frac in (0.25, 0.5, 0.75):
        after = int(frac * launch.nblocks)
        out.fill_(float("nan"))
        launch.ctl.zero_()
        zeroed = torch.cuda.Event()
        zeroed.record()
        side.wait_event(zeroed)
        # protocol 4 counts done bits; 5 has none and watches each row's first word (sampled)
        trigger.arm(launch, after, cd.Stream.borrow(side.cuda_stream), watch=out if launch.protocol == 5 else None,
                    words_per_block=x_cols(args), gate=GATE, threads=THREADS)
        launch._launch()
        torch.cuda.synchronize()
        res = trigger.result()
        pend = launch.pending()
        assert res["reached"] == 1 and res["done_seen"] >= after, res
        assert 0 < len(pend) < launch.nblocks, (frac, len(pend), res)  # mid-grid
        if res["sample_step"] == 1:
            assert len(pend) <= launch.nblocks - after, (frac, len(pend), res)  # at that count
        rows_nan = torch.isnan(out).all(dim=1)
        assert torch.equal(rows_nan, torch.isnan(out).any(dim=1))  # a row written whole or not at all
        assert torch.nonzero(rows_nan).flatten().tolist() == pend  # exactly the pending rows are unwritten
        launch.resume()
        launch.drain()
        assert launch.pending() == [] and torch.equal(out, want)
