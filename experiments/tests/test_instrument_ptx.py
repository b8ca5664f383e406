"""CPU CI: the PTX safe-point rewriter on real Triton 3.6 PTX for sm_90, every result assembled by ptxas.

Needs triton (it compiles for sm_90 without a GPU and bundles ptxas); no GPU, no driver.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

triton = pytest.importorskip("triton", reason="triton not installed")

from concordia_lab.errors import CompileError, PtxParseError, UnsafeKernelError  # noqa: E402
from concordia_lab.instrument import REFUSALS, SafepointOptions, decode_bitmap, plan_safepoints, rewrite_ptx  # noqa: E402
from concordia_lab.instrument.ptx import strip_comment  # noqa: E402
from concordia_lab.instrument.ptxas import assemble, find_ptxas  # noqa: E402
from concordia_lab.instrument.safepoints import block_index, ctl_bytes, pending_blocks  # noqa: E402
from instrument_kernels import compile_for_sm90  # noqa: E402

pytestmark = pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (triton bundles one)")


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
    yield
    mp.undo()


_PTX: dict[str, str] = {}


def ptx_of(name: str, **opts: object) -> str:
    key = name + repr(sorted(opts.items()))
    if key not in _PTX:
        _PTX[key] = compile_for_sm90(name, **opts).asm["ptx"]
    return _PTX[key]


def _probe_free(text: str) -> list[str]:
    """The lines of a rewritten module that the rewriter did not add."""
    out: list[str] = []
    for line in text.splitlines():
        if "concordia-ft" in line or "cft_" in line or "$__cft" in line or line.strip().startswith("$__cft"):
            continue
        out.append(line)
    return [ln for ln in out if ln.strip()]


@pytest.mark.parametrize("barriers", [False, True])
@pytest.mark.parametrize("name", ["matmul", "softmax", "layernorm", "atomic_sum"])
def test_rewritten_real_triton_ptx_assembles_for_sm90a(name: str, barriers: bool) -> None:
    src = ptx_of(name)
    res = rewrite_ptx(src, SafepointOptions(barrier_probes=barriers, protocol=4))
    (rep,) = res.kernels
    assert rep.instrumented and rep.entry_probes == 1 and rep.exit_probes == 1
    assert f".visible .global .align 8 .u64 cft_ctl_{rep.name};" in res.ptx
    before = assemble(src)
    after = assemble(res.ptx)  # raises CompileError with ptxas's log if the rewrite is not valid PTX
    assert after.cubin[:4] == b"\x7fELF"
    assert after.registers[rep.name] <= max(before.registers[rep.name] + 8, 32), after.log
    assert after.spill_bytes.get(rep.name, 0) <= before.spill_bytes.get(rep.name, 0), after.log


BARRIERS = SafepointOptions(barrier_probes=True, protocol=4)  # barrier probes exist in protocol 4 only


@pytest.mark.parametrize("late", [True, False])
def test_original_instructions_survive_except_probed_barriers(late: bool) -> None:
    src = ptx_of("softmax")
    res = rewrite_ptx(src, SafepointOptions(barrier_probes=True, late_reads=late, protocol=4))
    rep = res.kernels[0]
    kept = _probe_free(res.ptx)
    orig = [ln for ln in src.splitlines() if ln.strip()]
    bar = [i for i, ln in enumerate(orig) if re.match(r"\s*bar\.sync\s+0;", ln)]
    assert len(bar) == rep.barriers == 5 and rep.deferred_vote  # the first one carries the entry vote
    assert rep.barrier_probes == 4
    # late reads keep the vote's barrier itself on the disarmed path; otherwise it becomes the vote
    gone = set(bar[1:]) if late else set(bar)
    assert kept == [ln for i, ln in enumerate(orig) if i not in gone]
    assert res.ptx.count("bar.red.or.pred") == 5


def test_probe_kinds_per_kernel() -> None:
    mm = plan_safepoints(ptx_of("matmul"), options=BARRIERS)[0]
    assert mm.barrier_probes == 0 and "asynchronous" in (mm.entry_only or "")  # wgmma in flight at barriers
    at = plan_safepoints(ptx_of("atomic_sum"), options=BARRIERS)[0]
    assert at.refused is None and at.barrier_probes == 0 and "atomics" in (at.entry_only or "")
    ln = plan_safepoints(ptx_of("layernorm"), options=BARRIERS)[0]
    assert ln.entry_only is None and ln.barrier_probes == ln.barriers > 0
    off = plan_safepoints(ptx_of("softmax"), options=SafepointOptions(protocol=4))[0]  # entry probes only
    assert off.barrier_probes == 0 and off.entry_only == "barrier probes off"
    v5 = plan_safepoints(ptx_of("softmax"))[0]  # the default, protocol 5: no exit probes either
    assert v5.barrier_probes == 0 and v5.exit_probes == 0 and "protocol 5" in (v5.entry_only or "")


def test_barriers_after_a_global_store_are_not_safe_points() -> None:
    rep = plan_safepoints(ptx_of("copy_then_reduce"), options=BARRIERS)[0]
    assert rep.barriers > 0 and rep.barrier_probes == 0 and rep.entry_only is None
    res = rewrite_ptx(ptx_of("copy_then_reduce"), BARRIERS)
    assert "bar.red" not in res.ptx
    assemble(res.ptx)


@pytest.mark.parametrize("name,opts,reason", [
    ("grid_barrier", {}, "spin_wait"),
    ("last_block", {}, "atomic_control"),
    ("persistent_copy", {}, "persistent_grid"),
    ("pdl_scale", {}, "pdl"),
    ("matmul", {"num_ctas": 2}, "cluster"),
])
def test_unsafe_kernels_are_refused_by_name_and_left_unchanged(name: str, opts: dict[str, object],
                                                               reason: str) -> None:
    src = ptx_of(name, **opts)
    res = rewrite_ptx(src)
    (rep,) = res.kernels
    assert rep.refused == reason and reason in REFUSALS and rep.detail
    assert res.ptx == src and not res.changed
    with pytest.raises(UnsafeKernelError) as ei:
        rewrite_ptx(src, SafepointOptions(strict=True))
    assert ei.value.reason == reason and rep.name in str(ei.value)


def test_launch_level_refusal_from_compiler_metadata() -> None:
    src = ptx_of("softmax")
    name = plan_safepoints(src)[0].name
    res = rewrite_ptx(src, launch_refusals={name: ("cooperative", "metadata.launch_cooperative_grid")})
    assert res.kernels[0].refused == "cooperative" and res.ptx == src


def test_rewriting_twice_is_refused() -> None:
    once = rewrite_ptx(ptx_of("softmax")).ptx
    with pytest.raises(PtxParseError, match="already instrumented"):
        rewrite_ptx(once)


def test_not_ptx_is_a_clear_error() -> None:
    with pytest.raises(PtxParseError, match="not PTX"):
        rewrite_ptx("int main() { return 0; }")
    with pytest.raises(PtxParseError, match="never closed"):
        rewrite_ptx(".version 8.7\n.target sm_90a\n.address_size 64\n.visible .entry k()\n{\n\tret;\n")


_TWO_KERNELS = """
.version 8.7
.target sm_90a
.address_size 64

.visible .entry first(
\t.param .u64 first_param_0
)
{
\t.reg .pred \t%p<2>;
\t.reg .b32 \t%r<4>;
\t.reg .b64 \t%rd<3>;
\tld.param.u64 \t%rd1, [first_param_0];
\tmov.u32 \t%r1, %tid.x;
\tsetp.gt.u32 \t%p1, %r1, 31;
\t@%p1 bar.sync \t0;
\t@!%p1 bar.sync \t0;
\tcvta.to.global.u64 \t%rd2, %rd1;
\tst.global.u32 \t[%rd2], %r1;
\tret;
}

.visible .entry second(
\t.param .u64 second_param_0
)
{
\t.reg .b32 \t%r<3>;
\t.reg .b64 \t%rd<3>;
$L__BB1_0:
\tld.param.u64 \t%rd1, [second_param_0];
\tmov.u32 \t%r1, %ctaid.x;
\tbar.sync \t0;
\tcvta.to.global.u64 \t%rd2, %rd1;
\tst.global.u32 \t[%rd2], %r1;
\tbar.sync \t0;
\tret;
}

.visible .entry third(
\t.param .u64 third_param_0
)
{
\t.reg .pred \t%p<2>;
\t.reg .b32 \t%r<3>;
\t.reg .b64 \t%rd<3>;
\tld.param.u64 \t%rd1, [third_param_0];
\tmov.u32 \t%r1, %tid.x;
\tsetp.gt.u32 \t%p1, %r1, 31;
\t@%p1 ret;
\tbar.sync \t0;
\tcvta.to.global.u64 \t%rd2, %rd1;
\tst.global.u32 \t[%rd2], %r1;
\tret;
}
"""


def test_kernels_of_one_module_get_their_own_symbols_labels_and_keep_guards() -> None:
    res = rewrite_ptx(_TWO_KERNELS, SafepointOptions(barrier_probes=True, deferred_vote=False, protocol=4))
    a, b, c = res.kernels
    assert (a.name, b.name, c.name) == ("first", "second", "third")
    assert a.exit_probes == 1 and a.barrier_probes == 2  # both guarded barriers precede the store
    assert b.barrier_probes == 1 and b.barriers == 2  # the second barrier follows a store
    # a guarded ret could take the leader out before the barrier: no barrier probes, exits keep their guards
    assert c.exit_probes == 2 and c.barrier_probes == 0 and "guarded ret" in (c.entry_only or "")
    assert all(f"cft_ctl_{k}" in res.ptx for k in ("first", "second", "third"))
    assert all(f"$__cft{i}_run:" in res.ptx for i in range(3))
    assert "@%p1 bar.red.or.pred" in res.ptx and "@!%p1 bar.red.or.pred" in res.ptx  # guards kept
    assert "and.pred \t%cft_p6, %cft_p6, %p1;" in res.ptx  # the guarded ret's exit probe keeps its guard
    # the entry probe sits before the first label: a branch back to $L__BB1_0 does not rerun it
    sec = res.ptx[res.ptx.index(".entry second"):]
    assert sec.index("$__cft1_run:") < sec.index("$L__BB1_0:")
    assemble(res.ptx)


def test_ptxas_rejection_is_a_compile_error() -> None:
    bad = _TWO_KERNELS.replace("st.global.u32 \t[%rd2], %r1;", "st.global.u32 \t[%rd2], %r9;", 1)
    with pytest.raises(CompileError):
        assemble(bad)


@given(st.integers(1, 70), st.integers(1, 5), st.integers(1, 3), st.data())
def test_bitmap_indexes_round_trip(nx: int, ny: int, nz: int, data: st.DataObject) -> None:
    grid = (nx, ny, nz)
    n = nx * ny * nz
    picked = data.draw(st.sets(st.tuples(st.integers(0, nx - 1), st.integers(0, ny - 1), st.integers(0, nz - 1))))
    words = [0] * ((ctl_bytes(n) - 16) // 4)
    for x, y, z in picked:
        b = block_index(x, y, z, grid)
        words[b >> 5] |= 1 << (b & 31)
    done = sorted(block_index(x, y, z, grid) for x, y, z in picked)
    assert decode_bitmap(words, n) == done
    assert pending_blocks(words, n) == [b for b in range(n) if b not in set(done)]


def test_rewriter_and_interposer_import_without_torch_cuda_or_triton() -> None:
    from test_layering import _run_hidden

    body = (
        "from concordia_lab.instrument import rewrite_ptx\n"
        "import concordia_lab.instrument.ptxas, concordia_lab.instrument.interposer\n"
        f"src = {_TWO_KERNELS!r}\n"
        "res = rewrite_ptx(src)\n"
        "assert [k.name for k in res.kernels] == ['first', 'second', 'third'] and res.changed\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in BANNED]\n"
        "assert not bad, bad\n"
        "print('OK')\n"
    )
    p = _run_hidden(body)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]


@pytest.mark.parametrize("name", ["softmax", "layernorm", "matmul", "atomic_sum", "copy_then_reduce"])
def test_rewrite_assembles_across_compile_options(name: str) -> None:
    """The probes must stay valid PTX whatever Triton's layout choices: every num_warps, with and without
    barrier probes, and (matmul) every pipelining depth."""
    combos: list[dict[str, object]] = [{"num_warps": 4, "num_stages": 2}, {"num_warps": 8, "num_stages": 4}] \
        if name == "matmul" else [{"num_warps": w} for w in (1, 2, 8)]
    for opts in combos:
        src = ptx_of(name, **opts)
        for barriers in (False, True):
            res = rewrite_ptx(src, SafepointOptions(barrier_probes=barriers, protocol=4))
            assert res.kernels[0].instrumented
            assemble(res.ptx)
        assemble(rewrite_ptx(src).ptx)  # protocol 5


def test_entry_vote_is_deferred_to_the_first_barrier_when_nothing_global_precedes_it() -> None:
    src = ptx_of("softmax")
    res = rewrite_ptx(src, SafepointOptions(late_reads=False, protocol=4))  # the leader's reads issued at entry
    rep = res.kernel("softmax_kernel")
    assert rep.deferred_vote and rep.barrier_probes == 0
    body = res.ptx[res.ptx.index(".entry"):]
    lines = [strip_comment(ln).strip().rstrip(";") for ln in body.splitlines()]
    vote = next(i for i, ln in enumerate(lines) if ln.startswith("bar.red.or.pred"))
    reads = [i for i, ln in enumerate(lines) if ln.startswith("ld.volatile.global.u32") and "%cft_" in ln]
    loads = [i for i, ln in enumerate(lines) if "ld.global.b32" in ln]
    stores = [i for i, ln in enumerate(lines) if ln.startswith(("st.global", "@%p")) and "st.global" in ln]
    assert len(reads) == 2 and all(r < loads[0] for r in reads)  # the leader's reads go out before the row's
    assert loads[-1] < vote < stores[0]  # voted after the kernel's loads, before anything is written
    assert lines[vote + 1] == "@%cft_p2 ret"
    # the barrier it replaced is gone, every other barrier stays
    n_bar = sum(ln.startswith(("bar.sync", "barrier.sync")) for ln in lines)
    orig = src[src.index(".entry"):]
    assert n_bar == sum(strip_comment(ln).strip().startswith(("bar.sync", "barrier.sync"))
                        for ln in orig.splitlines()) - 1
    assert not any(ln.startswith("barrier.red") for ln in lines[:vote])  # no vote at entry
    a = assemble(res.ptx)
    plain = assemble(src)
    k = "softmax_kernel"
    assert a.spill_bytes[k] == plain.spill_bytes[k] and a.registers[k] <= plain.registers[k] + 4
    # off: the vote stays at entry
    off = rewrite_ptx(src, SafepointOptions(deferred_vote=False, protocol=4))
    assert not off.kernel("softmax_kernel").deferred_vote and "barrier.red.or.pred" in off.ptx
    assert "bar.red" not in off.ptx
    # a loop before the first barrier (a branch target): voted at entry
    ln = rewrite_ptx(ptx_of("layernorm")).kernel("layernorm_kernel")
    assert not ln.deferred_vote


def test_entry_vote_goes_before_the_first_global_write_in_straight_line_kernels() -> None:
    src = ptx_of("poi_silu_mul")
    res = rewrite_ptx(src, SafepointOptions(late_reads=False, protocol=4))  # the leader's reads issued at entry
    rep = res.kernel("poi_silu_mul_kernel")
    assert rep.deferred_vote and rep.vote_site == "before_write" and rep.barriers == 0
    body = res.ptx[res.ptx.index(".entry"):]
    lines = [strip_comment(ln).strip().rstrip(";") for ln in body.splitlines()]
    votes = [i for i, ln in enumerate(lines) if ln.startswith(("barrier.red", "bar.red"))]
    reads = [i for i, ln in enumerate(lines) if ln.startswith("ld.volatile.global.u32") and "%cft_" in ln]
    loads = [i for i, ln in enumerate(lines) if "ld.global.b16" in ln]
    stores = [i for i, ln in enumerate(lines) if "st.global" in ln]
    assert len(votes) == 1 and len(reads) == 2 and len(loads) == 4 and stores
    assert all(r < loads[0] for r in reads)  # the leader's reads go out at entry, before the block's loads
    assert loads[-1] < votes[0] < stores[0]  # voted after every load, before the first store
    assert lines[votes[0] + 1] == "@%cft_p2 ret"
    assert not any(ln.startswith(("bar.sync", "barrier.sync")) for ln in lines)  # no barrier of the kernel's
    a, plain = assemble(res.ptx), assemble(src)
    k = "poi_silu_mul_kernel"
    assert a.spill_bytes[k] == plain.spill_bytes[k] == 0 and a.registers[k] <= plain.registers[k] + 8  # 14 -> 22 (v3: 18)
    # the instructions of the kernel are all still there, in order
    assert _probe_free(res.ptx) == _probe_free(src)
    # option off: the version-3 probe, voted at entry
    off = rewrite_ptx(src, SafepointOptions(vote_before_write=False, late_reads=False, protocol=4)).kernel(k)
    assert off.vote_site == "entry" and not off.deferred_vote
    # a kernel whose first barrier precedes its first write keeps voting at that barrier
    assert rewrite_ptx(ptx_of("softmax")).kernel("softmax_kernel").vote_site == "barrier"
    # a loop before the first write (layernorm) or a write before the first barrier: voted at entry /
    # before the write, never at a barrier that follows a write
    assert rewrite_ptx(ptx_of("layernorm")).kernel("layernorm_kernel").vote_site == "entry"
    ctr = rewrite_ptx(ptx_of("copy_then_reduce")).kernel("copy_then_reduce_kernel")
    assert ctr.vote_site == "before_write"


def test_lazy_entry_only_the_leader_waits_for_the_control_pointer() -> None:
    k = "poi_silu_mul_kernel"
    src = ptx_of("poi_silu_mul")
    res = rewrite_ptx(src, SafepointOptions(lazy_entry=True, late_reads=False, protocol=4))
    assert res.kernel(k).vote_site == "before_write"
    body = res.ptx[res.ptx.index(".entry"):]
    lines = [strip_comment(ln).strip().rstrip(";") for ln in body.splitlines()]
    ptr = next(i for i, ln in enumerate(lines) if ln.startswith("ld.global.u64") and "cft_ctl_" in ln)
    lead = next(i for i, ln in enumerate(lines) if ln.startswith("@!%cft_p0 bra"))
    uses = [i for i, ln in enumerate(lines) if "%cft_rd0" in ln and i != ptr]
    assert ptr < lead < uses[0]  # non-leaders branch past before anything reads the pointer
    vote = next(i for i, ln in enumerate(lines) if ln.startswith("barrier.red.or.pred"))
    skip = [i for i, ln in enumerate(lines) if ln.startswith("@!%cft_p1 bra") and ln.endswith("_novote")]
    assert len(skip) == 1 and skip[0] < vote and lines[skip[0] - 1].startswith("setp.ne.u64 \t%cft_p1, %cft_rd0")
    stores = [i for i, ln in enumerate(lines) if "st.global" in ln]
    novote = next(i for i, ln in enumerate(lines) if ln.endswith("_novote:"))
    assert vote < novote < stores[0]  # a disarmed launch skips the inserted barrier, then stores
    assert _probe_free(res.ptx) == _probe_free(src)
    a = assemble(res.ptx)
    assert a.spill_bytes[k] == 0
    # where the vote sits at the kernel's own barrier, that barrier stays unconditional
    sm = rewrite_ptx(ptx_of("softmax"), SafepointOptions(lazy_entry=True, late_reads=False, protocol=4))
    assert sm.kernel("softmax_kernel").vote_site == "barrier" and "_novote" not in sm.ptx
    assemble(sm.ptx)


INDUCTOR_PTX = sorted((Path(__file__).parent / "data" / "h200" / "inductor-qwen3-ptx").glob("*.ptx"))


@pytest.mark.parametrize("path", INDUCTOR_PTX, ids=lambda p: p.stem[:40])
def test_real_inductor_qwen3_ptx_rewrites_and_assembles_under_every_probe_option(path: Path) -> None:
    """PTX of the compiled Qwen3 layer's Triton kernels, from the plain worker of bench_qwen3_probes on the H200
    (its .file paths and DWARF sections stripped; the device's Triton wrote PTX ISA 9.0, the ptxas bundled here
    takes 8.7, and the kernels use nothing newer)."""
    src = path.read_text().replace(".version 9.0", ".version 8.7")
    assert "cft_" not in src  # the baseline worker's cache held no probe
    plain = assemble(src)
    (k,) = plain.registers
    sites = set()
    for opts in (SafepointOptions(vote_before_write=False, late_reads=False, protocol=4),
                 SafepointOptions(late_reads=False, protocol=4),
                 SafepointOptions(lazy_entry=True, late_reads=False, protocol=4),
                 SafepointOptions(late_reads=True, protocol=4), SafepointOptions(protocol=5),
                 SafepointOptions(vote_before_write=False, protocol=5)):
        res = rewrite_ptx(src, opts)
        rep = res.kernel(k)
        assert rep.instrumented and (rep.exit_probes >= 1) == (opts.protocol == 4), rep
        a = assemble(res.ptx)
        assert a.spill_bytes[k] == plain.spill_bytes[k] == 0 and a.registers[k] <= plain.registers[k] + 12
        assert _probe_free(res.ptx) == _probe_free(src) or rep.vote_site == "barrier"
        sites.add((opts.vote_before_write, rep.vote_site))
    if "_poi_" in k:  # pointwise: straight-line loads -> math -> stores; version 4 votes before the first store
        assert sites == {(False, "entry"), (True, "before_write")}


def test_late_reads_leave_nothing_waiting_at_entry() -> None:
    src = ptx_of("poi_silu_mul")
    k = "poi_silu_mul_kernel"
    res = rewrite_ptx(src, SafepointOptions(late_reads=True, protocol=4))
    assert res.kernel(k).vote_site == "before_write"
    body = res.ptx[res.ptx.index(".entry"):]
    lines = [strip_comment(ln).strip().rstrip(";") for ln in body.splitlines()]
    ptr = next(i for i, ln in enumerate(lines) if ln.startswith("ld.global.u64") and "cft_ctl_" in ln)
    loads = [i for i, ln in enumerate(lines) if "ld.global.b16" in ln]
    first_use = next(i for i, ln in enumerate(lines) if "%cft_rd0" in ln and i != ptr)
    reads = [i for i, ln in enumerate(lines) if ln.startswith("ld.volatile.global.u32")]
    vote = next(i for i, ln in enumerate(lines) if ln.startswith("barrier.red.or.pred"))
    stores = [i for i, ln in enumerate(lines) if "st.global" in ln]
    assert ptr < loads[0] and loads[-1] < first_use  # the pointer is first used after the block's own loads
    assert lines[first_use].startswith("setp.ne.u64 \t%cft_p1, %cft_rd0") and lines[first_use + 1].endswith("_novote")
    assert len(reads) == 2 and first_use < reads[0] < vote < stores[0]  # the leader reads at the vote, armed only
    assert _probe_free(res.ptx) == _probe_free(src)
    assemble(res.ptx)
    # at a kernel's own barrier: disarmed launches pass the original barrier, armed ones vote in its place
    sm = rewrite_ptx(ptx_of("softmax"), SafepointOptions(late_reads=True, protocol=4))
    t = sm.ptx
    assert sm.kernel("softmax_kernel").vote_site == "barrier" and "_avote" in t and "_vdone" in t
    n_bar = lambda text: sum(strip_comment(ln).strip().startswith("bar.sync") for ln in text.splitlines())  # noqa: E731
    assert n_bar(t) == n_bar(ptx_of("softmax"))  # the original barrier kept, on the disarmed path
    assemble(t)
    for name in ("softmax", "layernorm", "atomic_sum"):  # with barrier probes too
        assemble(rewrite_ptx(ptx_of(name), SafepointOptions(late_reads=True, barrier_probes=True, protocol=4)).ptx)
