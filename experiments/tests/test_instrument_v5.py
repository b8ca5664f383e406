"""CPU CI: protocol 5 ("record on pause") of the safe-point rewriter.

- the probes on real Triton 3.6 PTX for sm_90, assembled by ptxas (registers reported, no spills): one 64-bit
  header load at the vote in the normal path, no exit probes, no done bits;
- the leader's decision, executed from the emitted PTX by a small interpreter of the opcodes it uses, equals
  ``safepoints.v5_decide`` on random states (the model the host side and the tests below use);
- exactly-once over repeated pause/resume: launch sequences of several kernels (a kernel launched many times
  with differing grids, as the Qwen3 layer's q/k norm kernel and a stack of layers do), pauses landing at
  random points of the vote order, resumed again and again: every (launch, block) runs once, in an order that
  keeps the call's launch order, and ``v5_pending`` names exactly what has not run after every drain.
"""

from __future__ import annotations

import random
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton", reason="triton not installed")

from concordia_lab.errors import InstrumentError  # noqa: E402
from concordia_lab.instrument import SafepointOptions, rewrite_ptx  # noqa: E402
from concordia_lab.instrument.ptx import strip_comment  # noqa: E402
from concordia_lab.instrument.ptxas import assemble, find_ptxas  # noqa: E402
from concordia_lab.instrument.safepoints import (  # noqa: E402
    HDR_BYTES,
    MODE_RESUME,
    MODE_RUN,
    REC_BYTES,
    v5_align_log2,
    v5_ctl_value,
    v5_decide,
    v5_pending,
    v5_totals,
)
from instrument_kernels import compile_for_sm90  # noqa: E402

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="no ptxas (triton bundles one)")

_PTX: dict[str, str] = {}
# protocol 5 as session 8 built it (the pointer global, the header read at the vote): the layout tests pin it
V5_BASE = {"const_ctl": False, "entry_header": False, "stmatrix_sync": False}


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
    yield
    mp.undo()


def ptx_of(name: str) -> str:
    if name not in _PTX:
        _PTX[name] = compile_for_sm90(name).asm["ptx"]
    return _PTX[name]


def _lines(text: str) -> list[str]:
    body = text[text.index(".entry"):]
    return [strip_comment(ln).strip().rstrip(";") for ln in body.splitlines()]


def _probe_free(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip() and not ("concordia-ft" in ln or "cft_" in ln or "$__cft" in ln)]


@needs_ptxas
@pytest.mark.parametrize("name,site", [("poi_silu_mul", "before_write"), ("softmax", "barrier"),
                                       ("layernorm", "entry"), ("matmul", "entry"), ("atomic_sum", "barrier"),
                                       ("copy_then_reduce", "before_write")])
def test_protocol5_probes_assemble_with_no_exit_probe_and_one_header_load(name: str, site: str) -> None:
    src = ptx_of(name)
    res = rewrite_ptx(src, SafepointOptions(**V5_BASE))  # the default is protocol 5
    (rep,) = res.kernels
    assert rep.instrumented and rep.vote_site == site and rep.exit_probes == 0 and rep.barrier_probes == 0
    assert f".visible .global .align 4 .u32 cft_proto_{rep.name} = 5;" in res.ptx
    lines = _lines(res.ptx)
    assert not any(ln.startswith("red.global") and "%cft_" in ln for ln in lines)  # no done bits
    hdr = [i for i, ln in enumerate(lines) if ln.startswith("ld.volatile.global.v2.u32 \t{%cft_r12, %cft_r13}")]
    assert len(hdr) == 1  # the normal path's only read: the header's (pause, mode) pair, one 64-bit load
    # after it, the normal path branches straight to the vote: nothing else read or written
    assert lines[hdr[0] + 2].startswith("setp.eq.u32 \t%cft_p3, %cft_r11, 0")
    assert lines[hdr[0] + 3].startswith("@%cft_p3 bra") and lines[hdr[0] + 3].endswith("_lread")
    ptr = [i for i, ln in enumerate(lines) if ln.startswith("ld.global.u64") and "cft_ctl_" in ln]
    assert len(ptr) == 1 and ptr[0] < hdr[0]
    vote = next(i for i, ln in enumerate(lines) if ln.startswith(("barrier.red.or.pred", "bar.red.or.pred")))
    assert hdr[0] < vote and lines[vote + 1] == "@%cft_p2 ret"
    stores = [i for i, ln in enumerate(lines) if "st.global" in ln and "%cft_" not in ln]
    if stores:
        assert vote < stores[0]  # the decision comes before the kernel's first global write
    if site == "before_write":
        assert _probe_free(res.ptx) == _probe_free(src)  # every instruction of the kernel kept, in order
    plain, a = assemble(src), assemble(res.ptx)
    k = rep.name
    v4 = assemble(rewrite_ptx(src, SafepointOptions(protocol=4)).ptx)
    early = rewrite_ptx(src, SafepointOptions(early_header=True, **V5_BASE))
    ea = assemble(early.ptx)
    print(f"{name}: registers plain {plain.registers[k]} v4 {v4.registers[k]} v5 {a.registers[k]} "
          f"v5 early header {ea.registers[k]}")
    assert ea.spill_bytes.get(k, 0) == plain.spill_bytes.get(k, 0)
    el = _lines(early.ptx)
    if site != "entry":  # the early read sits after the kernel's last global load before the vote
        at = next(i for i, ln in enumerate(el) if ln.startswith("ld.volatile.global.v2.u32 \t{%cft_r12"))
        ev = next(i for i, ln in enumerate(el) if ln.startswith(("barrier.red.or.pred", "bar.red.or.pred")))
        own = [i for i, ln in enumerate(el) if re.match(r"(@%p\d+ )?ld\.global", ln) and "cft_" not in ln]
        assert at < ev and [i for i in own if i < ev and i > at] == []
        assert sum(ln.startswith("ld.volatile.global.v2.u32 \t{%cft_r12") for ln in el) == 1
    assert a.spill_bytes.get(k, 0) == plain.spill_bytes.get(k, 0)
    assert a.registers[k] <= max(plain.registers[k] + 6, 32), a.log


@needs_ptxas
@pytest.mark.parametrize("name", ["poi_silu_mul", "softmax", "layernorm", "matmul", "copy_then_reduce"])
def test_cold_path_moves_the_leaders_rare_path_after_the_kernels_last_instruction(name: str) -> None:
    src = ptx_of(name)
    hot, cold = rewrite_ptx(src), rewrite_ptx(src, SafepointOptions(cold_path=True))
    lines = _lines(cold.ptx)
    close = max(i for i, ln in enumerate(lines) if ln == "}")
    rare = next(i for i, ln in enumerate(lines) if ln.endswith("_rare:"))
    last_ret = max(i for i, ln in enumerate(lines[:rare]) if ln == "ret")
    assert last_ret < rare < close  # after the kernel's last instruction, reached only by its branch
    assert sum(ln.endswith("_rare") and "bra" in ln for ln in lines) == 1
    # the normal path: the header test, one branch to the rare path, and the vote right after
    hdr = next(i for i, ln in enumerate(lines) if ln.startswith("setp.eq.u32 \t%cft_p3, %cft_r11, 0"))
    assert lines[hdr + 1].startswith("@!%cft_p3 bra") and lines[hdr + 2].endswith("_lread:")
    assert lines[hdr + 3].startswith("setp.ne.u32 \t%cft_p2, %cft_r14, 0")
    # the same instructions otherwise: both sets, sorted, differ only by the branches and labels that move
    def body(text: str) -> list[str]:
        return sorted(ln for ln in _lines(text) if ln and "bra" not in ln and not ln.endswith(":"))
    assert body(hot.ptx) == body(cold.ptx)
    k = cold.kernels[0].name
    plain, a = assemble(src), assemble(cold.ptx)
    print(f"{name}: registers plain {plain.registers[k]} default {assemble(hot.ptx).registers[k]} cold {a.registers[k]}")
    assert a.spill_bytes.get(k, 0) == plain.spill_bytes.get(k, 0)


@needs_ptxas
@pytest.mark.parametrize("name,site", [("poi_silu_mul", "before_write"), ("softmax", "barrier"),
                                       ("layernorm", "entry"), ("copy_then_reduce", "before_write")])
def test_const_ctl_and_entry_header_put_the_pointer_in_the_constant_bank_and_the_header_read_at_entry(
        name: str, site: str) -> None:
    src = ptx_of(name)
    res = rewrite_ptx(src, SafepointOptions(const_ctl=True, entry_header=True))
    (rep,) = res.kernels
    k = rep.name
    assert rep.instrumented and rep.vote_site == site
    assert f".visible .const .align 8 .u64 cft_ctl_{k};" in res.ptx
    assert f".visible .global .align 8 .u64 cft_ctl_{k};" not in res.ptx
    lines = _lines(res.ptx)
    ptr = [i for i, ln in enumerate(lines) if "cft_ctl_" in ln and ln.startswith("ld.")]
    assert len(ptr) == 1 and lines[ptr[0]].startswith("ld.const.u64")
    hdr = [i for i, ln in enumerate(lines) if ln.startswith("ld.volatile.global.v2.u32 \t{%cft_r12, %cft_r13}")]
    assert len(hdr) == 1 and ptr[0] < hdr[0]
    own = [i for i, ln in enumerate(lines) if re.match(r"(@%p\d+ )?ld\.global", ln) and "cft_" not in ln]
    if site != "entry":
        assert own and hdr[0] < own[0]  # issued before any of the kernel's own loads
    vote = next(i for i, ln in enumerate(lines) if ln.startswith(("barrier.red.or.pred", "bar.red.or.pred")))
    assert hdr[0] < vote and lines[vote + 1] == "@%cft_p2 ret"
    if site == "before_write":
        assert _probe_free(res.ptx) == _probe_free(src)
    plain, a = assemble(src), assemble(res.ptx)
    print(f"{name}: registers plain {plain.registers[k]} const+entry {a.registers[k]}")
    assert a.spill_bytes.get(k, 0) == plain.spill_bytes.get(k, 0)
    assert a.registers[k] <= max(plain.registers[k] + 6, 32), a.log
    # const_ctl alone keeps the header read at the vote
    c = _lines(rewrite_ptx(src, SafepointOptions(const_ctl=True, entry_header=False)).ptx)
    ch = next(i for i, ln in enumerate(c) if ln.startswith("ld.volatile.global.v2.u32 \t{%cft_r12"))
    cv = next(i for i, ln in enumerate(c) if ln.startswith(("barrier.red.or.pred", "bar.red.or.pred")))
    assert any(ln.startswith("ld.const.u64") and "cft_ctl_" in ln for ln in c) and ch < cv
    assemble(rewrite_ptx(src, SafepointOptions(const_ctl=True, entry_header=False)).ptx)
    assert rewrite_ptx(src).ptx == res.ptx  # today's default: both (stmatrix_sync changes none of these)


def test_protocol5_refuses_barrier_probes_and_unknown_protocols() -> None:
    with pytest.raises(InstrumentError, match="protocol 4 only"):
        SafepointOptions(barrier_probes=True)
    # the protocol-5 options leave protocol 4's code as it was (its pointers are written from the stream)
    v4 = {"protocol": 4, "const_ctl": False, "entry_header": False, "stmatrix_sync": False}
    for opt in ("const_ctl", "entry_header", "early_header", "stmatrix_sync"):
        for name in ("softmax", "poi_silu_mul"):
            assert rewrite_ptx(ptx_of(name), {**v4, opt: True}).ptx == rewrite_ptx(ptx_of(name), v4).ptx
    with pytest.raises(InstrumentError, match="protocols 4 and 5"):
        rewrite_ptx(ptx_of("softmax"), {"protocol": 3})
    # refusals are the same under both protocols: the kernel is left byte-for-byte unchanged
    gb = ptx_of("grid_barrier")
    res = rewrite_ptx(gb)
    assert res.kernels[0].refused == "spin_wait" and res.ptx == gb


# ---- the leader's decision, run from the emitted PTX --------------------------------------------------------

_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1


_SNIPPET_OPTIONS = {"vote": SafepointOptions(**V5_BASE), "early": SafepointOptions(early_header=True, **V5_BASE),
                    "entry": SafepointOptions(entry_header=True, const_ctl=True),
                    "cold": SafepointOptions(cold_path=True), "cold_vote": SafepointOptions(cold_path=True, **V5_BASE),
                    "harg": SafepointOptions(header_arg=True), "harg_cold": SafepointOptions(header_arg=True, cold_path=True),
                    "harg_vote": SafepointOptions(header_arg=True, **V5_BASE),
                    "harg_gpu": SafepointOptions(header_arg=True, header_gpu_scope=True),
                    "gpu_scope": SafepointOptions(header_gpu_scope=True)}
_HARG = ("harg", "harg_cold", "harg_vote", "harg_gpu")


def _leader_snippet(where: str = "vote") -> list[str]:
    """The instructions of the v5 leader decision as rewrite_ptx emits them (poi_silu_mul's vote site); with
    the header read early (after the last load, or at entry), that read (and the zeroing at entry) in front,
    as the thread meets them."""
    opts = _SNIPPET_OPTIONS[where]
    early = opts.early_header or opts.entry_header
    lines = _lines(rewrite_ptx(ptx_of("poi_silu_mul"), opts).ptx)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("mov.u32 \t%cft_r14, 0"))
    end = next(i for i, ln in enumerate(lines) if ln.endswith("_lread:"))
    code = lines[start:end + 1]
    if opts.cold_path:  # the rare path after the kernel's last instruction: run it where the branch goes
        r0 = next(i for i, ln in enumerate(lines) if ln.endswith("_rare:"))
        r1 = max(i for i in range(r0, len(lines)) if lines[i].startswith("bra.uni") and lines[i].endswith("_lread"))
        assert r0 > end and not any(ln.endswith("_rare:") for ln in code)
        code = [*code, "bra.uni \t$__snippet_end", *lines[r0:r1 + 1], "$__snippet_end:"]
    if early:
        e_end = next(i for i, ln in enumerate(lines) if ln.endswith("_early:"))
        e_start = next(i for i, ln in enumerate(lines) if ln.startswith("@!%cft_p0 bra") and ln.endswith("_early"))
        code = ["mov.u32 \t%cft_r12, 0", "mov.u32 \t%cft_r13, 0", *lines[e_start - 6:e_end + 1], *code]
    return code


def _alu(op: str, ops: list[str], val: Callable[[str], int], regs: dict[str, int]) -> None:
    """One register instruction of the emitted probe code (what both interpreters below share)."""
    d = ops[0]
    m = _M64 if any(x in op for x in (".u64", ".b64", ".s64")) else _M32
    if op in ("mov.u32", "mov.u64"):
        regs[d] = val(ops[1]) & m
    elif op == "cvt.u32.u64":
        regs[d] = val(ops[1]) & _M32
    elif op.startswith("and.b"):
        regs[d] = val(ops[1]) & val(ops[2]) & m
    elif op.startswith("or.b"):
        regs[d] = (val(ops[1]) | val(ops[2])) & m
    elif op.startswith("shl.b"):
        regs[d] = (val(ops[1]) << val(ops[2])) & m
    elif op == "shr.u32":
        regs[d] = (val(ops[1]) >> val(ops[2])) & _M32
    elif op.startswith("add."):
        regs[d] = (val(ops[1]) + val(ops[2])) & m
    elif op == "mad.lo.u32":
        regs[d] = (val(ops[1]) * val(ops[2]) + val(ops[3])) & _M32
    elif op == "mul.wide.u32":
        regs[d] = (val(ops[1]) * val(ops[2])) & _M64
    elif op.startswith("setp."):
        a, b = val(ops[1]), val(ops[2])
        r = {"eq": a == b, "ne": a != b, "le": a <= b, "lt": a < b}[op.split(".")[1]]
        if op.startswith(("setp.eq.and", "setp.ne.and")):
            r = r and bool(regs[ops[3]])
        regs[d] = int(r)
    elif op in ("selp.b32", "selp.u32"):
        regs[d] = val(ops[1]) if regs[ops[3]] else val(ops[2])
    else:
        raise AssertionError(f"the interpreter does not know {op!r}: extend it with the rewriter")


def _run_leader(code: list[str], ctl: int, mem: dict[int, int], tid: tuple[int, int, int],
                ctaid: tuple[int, int, int], nctaid: tuple[int, int, int],
                symbols: dict[str, int] | None = None) -> tuple[int, list[tuple[int, int]]]:
    """Execute the snippet for one thread: returns (%cft_r14, the stores made as (address, u32)). ``ctl`` is what
    the entry loaded into ``%cft_rd0`` (the control pointer; header_arg: the header parameter); ``symbols``: the
    u64 module globals a load by name reads (header_arg's rare path loads ``cft_ctl_``)."""
    regs: dict[str, int] = {"%cft_rd0": ctl}
    syms = symbols or {}
    special = {"%tid.x": tid[0], "%tid.y": tid[1], "%tid.z": tid[2], "%ctaid.x": ctaid[0], "%ctaid.y": ctaid[1],
               "%ctaid.z": ctaid[2], "%nctaid.x": nctaid[0], "%nctaid.y": nctaid[1]}
    labels = {ln[:-1]: i for i, ln in enumerate(code) if ln.endswith(":")}
    stores: list[tuple[int, int]] = []

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in special:
            return special[tok]
        if tok.startswith("%"):
            return regs[tok]
        return int(tok, 0) & _M64

    def addr(tok: str) -> int:
        inner = tok.strip()[1:-1]
        base, _, off = inner.partition("+")
        return (val(base) + (int(off) if off else 0)) & _M64

    pc, steps = 0, 0
    while pc < len(code):
        steps += 1
        assert steps < 200
        ln = code[pc]
        pc += 1
        if ln.endswith(":"):
            continue
        guard = ""
        if ln.startswith("@"):
            guard, ln = ln.split(None, 1)
        op, _, rest = ln.partition(" ")
        rest = rest.strip()
        if guard:
            g = guard[1:]
            want = not g.startswith("!")
            if bool(regs[g.lstrip("!")]) != want:
                continue
        ops = [t.strip() for t in re.split(r",(?![^{]*})", rest)] if rest else []
        if op.startswith("bra"):
            pc = labels[ops[0]]
            continue
        if op in ("ld.const.u64", "ld.global.u64"):
            regs[ops[0]] = syms[ops[1].strip()[1:-1]]  # a module global, by name
            continue
        if op.startswith(("ld.volatile.global.v2.u32", "ld.relaxed.gpu.global.v2.u32")):
            a = addr(ops[1])
            d = ops[0].strip("{}").split(",")
            regs[d[0].strip()] = mem.get(a, 0)
            regs[d[1].strip()] = mem.get(a + 4, 0)
            continue
        if op.startswith("st.volatile.global.v2.u32"):
            a = addr(ops[0])
            s = ops[1].strip("{}").split(",")
            stores += [(a, val(s[0]) & _M32), (a + 4, val(s[1]) & _M32)]
            continue
        if op.startswith("st.volatile.global.u32"):
            stores.append((addr(ops[0]), val(ops[1]) & _M32))
            continue
        _alu(op, ops, val, regs)
    return regs["%cft_r14"], stores


@given(st.integers(MODE_RUN, MODE_RESUME), st.integers(0, 1), st.integers(0, 5), st.integers(0, 6),
       st.integers(6, 20), st.integers(0, 3), st.integers(0, 2),
       st.sampled_from(sorted(set(_SNIPPET_OPTIONS) - set(_HARG))),
       st.data())
@settings(max_examples=200, deadline=None)
def test_the_emitted_leader_code_computes_v5_decide(mode: int, pause: int, s: int, rem: int, align: int,
                                                    kreg: int, bx: int, where: str, data: st.DataObject) -> None:
    code = _leader_snippet(where)
    grid = (3, 2, 2)
    by, bz = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    b = (bz * grid[1] + by) * grid[0] + bx
    align = max(align, v5_align_log2(HDR_BYTES + 64 * kreg + REC_BYTES * 12))  # the arena fits its alignment
    base = (0x7F1234567000 >> align) << align  # some 2**align-aligned device address
    region = base + HDR_BYTES + 64 * kreg
    ctl = v5_ctl_value(region, align)
    rec = region + REC_BYTES * b
    mem = {base: pause, base + 4: mode, rec: s, rec + 4: rem}
    leave, stores = _run_leader(code, ctl, mem, (0, 0, 0), (bx, by, bz), grid)
    runs, s2, rem2 = v5_decide(mode, pause, s, rem)
    assert leave == int(not runs)
    after = dict(mem)
    after.update(stores)
    assert (after[rec], after[rec + 4]) == (s2, rem2)
    assert all(a in (rec, rec + 4) for a, _ in stores)  # only its own record is written
    if mode == MODE_RUN and pause == 0:
        assert stores == []  # the normal path writes nothing
    # a thread other than the leader decides nothing and writes nothing
    other, st2 = _run_leader(code, ctl, mem, (1, 0, 0), (bx, by, bz), grid)
    assert other == 0 and st2 == []


@given(st.integers(MODE_RUN, MODE_RESUME), st.integers(0, 1), st.integers(0, 5), st.integers(0, 6),
       st.integers(6, 20), st.integers(0, 3), st.integers(0, 2), st.sampled_from(_HARG),
       st.sampled_from(["own", "disarmed", "other_call"]), st.data())
@settings(max_examples=200, deadline=None)
def test_header_arg_leader_code_computes_v5_decide_and_runs_a_kernel_of_another_call(
        mode: int, pause: int, s: int, rem: int, align: int, kreg: int, bx: int, where: str, ctl_of: str,
        data: st.DataObject) -> None:
    """header_arg: %cft_rd0 is the header parameter itself. With its kernel's cft_ctl_ naming that header's arena
    the decision is v5_decide's; with cft_ctl_ zero (the kernel disarmed) or naming another arena (the launch
    read the header of a call this kernel is not armed in) the block runs and writes nothing, whatever the
    header says."""
    code = _leader_snippet(where)
    sym = next(ln.split("[")[1].rstrip("];") for ln in code if ln.startswith(("ld.const.u64", "ld.global.u64")))
    grid = (3, 2, 2)
    by, bz = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    b = (bz * grid[1] + by) * grid[0] + bx
    align = max(align, v5_align_log2(HDR_BYTES + 64 * kreg + REC_BYTES * 12))
    base = (0x7F1234567000 >> align) << align
    region = base + HDR_BYTES + 64 * kreg
    rec = region + REC_BYTES * b
    mem = {base: pause, base + 4: mode, rec: s, rec + 4: rem}
    other = base + (1 << (align + 1))  # another call's arena, with the same layout
    ctl = {"own": v5_ctl_value(region, align), "disarmed": 0,
           "other_call": v5_ctl_value(other + HDR_BYTES + 64 * kreg, align)}[ctl_of]
    leave, stores = _run_leader(code, base, mem, (0, 0, 0), (bx, by, bz), grid, {sym: ctl})
    if ctl_of != "own":
        assert (leave, stores) == (0, [])
        return
    runs, s2, rem2 = v5_decide(mode, pause, s, rem)
    assert leave == int(not runs)
    after = dict(mem)
    after.update(stores)
    assert (after[rec], after[rec + 4]) == (s2, rem2)
    assert all(a in (rec, rec + 4) for a, _ in stores)
    if mode == MODE_RUN and pause == 0:
        assert stores == []
    assert _run_leader(code, base, mem, (1, 0, 0), (bx, by, bz), grid, {sym: ctl}) == (0, [])


def test_header_arg_reads_no_memory_before_a_disarmed_launchs_branch() -> None:
    """A disarmed header_arg launch (a null parameter) reaches the kernel's own code having loaded nothing but
    the parameter: the entry issues no global or constant load."""
    for name in ("poi_silu_mul", "softmax", "layernorm"):
        lines = _lines(rewrite_ptx(ptx_of(name), SafepointOptions(header_arg=True)).ptx)
        probe = [ln for ln in lines if "%cft_" in ln and ln.startswith("ld.")]
        assert probe[0].startswith("ld.param.u64 \t%cft_rd0")
        loads = [ln for ln in probe[1:] if not ln.startswith("ld.volatile.global.v2.u32 \t{%cft_r12")]
        # the only other loads: the rare path's records pointer and its record
        assert [ln.split()[0] for ln in loads] == ["ld.global.u64", "ld.volatile.global.v2.u32"], (name, loads)
        assemble(rewrite_ptx(ptx_of(name), SafepointOptions(header_arg=True)).ptx)


@needs_ptxas
def test_header_arg_declares_nothing_in_the_constant_bank() -> None:
    """With header_arg the records' pointer is read on the rare path only, so it lives in global memory: a module
    with a .const variable pays at every launch of its kernels (a constant bank bound, +0.10 us per launch on the
    H200, DESIGN.md §6i) even where no instruction reads it. The cubin has no module constant bank (bank 3);
    const_ctl without header_arg keeps the pointer there (its every thread reads it at entry)."""
    cuobjdump = Path(find_ptxas() or "ptxas").with_name("cuobjdump")
    for name in ("poi_silu_mul", "softmax", "layernorm"):
        banks = {}
        for label, opts in (("harg", SafepointOptions(header_arg=True)), ("default", SafepointOptions())):
            ptx = rewrite_ptx(ptx_of(name), opts).ptx
            cubin = assemble(ptx).cubin
            consts = [ln for ln in ptx.splitlines() if ln.startswith(".visible .const")]
            banks[label] = consts
            if cuobjdump.exists():
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(cubin)
                    f.flush()
                    elf = subprocess.run([str(cuobjdump), "-elf", f.name], capture_output=True, text=True,
                                         check=True).stdout
                assert (".nv.constant3" in elf) == (label == "default"), (name, label)
        assert banks["harg"] == [] and len(banks["default"]) == 1, (name, banks)


# ---- exactly once across repeated pause / resume -----------------------------------------------------------

def _simulate(grids_by_kernel: dict[str, list[int]], order: list[tuple[str, int]], rng: random.Random,
              pauses: list[float]) -> None:
    """Calls of one launch sequence (``order``: (kernel, occurrence) in call order), each paused at a random
    point of its votes, as the device does it (v5_decide per block leader), then resumed until nothing is
    pending; checks exactly-once, order and v5_pending after every drain."""
    rec = {k: [[0, 0] for _ in range(max(g))] for k, g in grids_by_kernel.items()}
    ran: dict[tuple[int, int], int] = {}  # (launch index, block) -> call number
    mode = MODE_RUN
    ncalls = 0
    for call in range(len(pauses) + 1):
        ncalls += 1
        if mode == MODE_RESUME:
            for k, g in grids_by_kernel.items():  # begin_resume: the countdowns
                for b, t in enumerate(v5_totals(g, max(g))):
                    rec[k][b][1] = t
        total_votes = sum(grids_by_kernel[k][o] for k, o in order)
        frac = pauses[call] if call < len(pauses) else None
        at = None if frac is None else int(frac * total_votes)
        votes = 0
        for li, (k, o) in enumerate(order):
            n = grids_by_kernel[k][o]
            blocks = list(range(n))
            rng.shuffle(blocks)  # blocks of one launch vote in any order
            for b in blocks:
                pause = int(at is not None and votes >= at)
                votes += 1
                runs, s2, r2 = v5_decide(mode, pause, rec[k][b][0], rec[k][b][1])
                rec[k][b] = [s2, r2]
                if runs:
                    assert (li, b) not in ran, f"launch {li} block {b} ran twice"
                    # launch order: nothing of a later launch ran in an earlier call than this one
                    assert all(c <= call for (lj, _), c in ran.items() if lj < li)
                    assert not any(lj > li and c < call for (lj, _), c in ran.items()), "ran out of order"
                    ran[(li, b)] = call
        # the drain: what the host computes from the records equals what has not run
        for k, g in grids_by_kernel.items():
            pend = v5_pending(g, [r[0] for r in rec[k]])
            idx = [li for li, (kk, _) in enumerate(order) if kk == k]
            for occ, li in enumerate(idx):
                assert pend[occ] == sorted(b for b in range(g[occ]) if (li, b) not in ran), (k, occ, call)
        left = sum(grids_by_kernel[k][o] for k, o in order) - len(ran)
        if left == 0:
            mode = MODE_RUN
            assert all(r[0] == 0 for rs in rec.values() for r in rs)  # records clean: the next call is plain
            break
        mode = MODE_RESUME
    else:
        raise AssertionError("still pending after the last call")
    assert len(ran) == sum(grids_by_kernel[k][o] for k, o in order) and ncalls <= len(pauses) + 1


@given(st.integers(0, 10_000), st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4))
@settings(max_examples=120, deadline=None)
def test_every_block_of_every_launch_runs_exactly_once_over_repeated_pauses(seed: int,
                                                                            pauses: list[float]) -> None:
    rng = random.Random(seed)
    # a layer-like call repeated 3 times: norm kernel twice per layer with different grids (q and k heads),
    # a pointwise kernel once, another kernel once; plus a kernel with a single launch
    grids = {"norm": [], "mlp": [], "attn": [], "tail": [rng.randint(1, 9)]}
    order: list[tuple[str, int]] = []
    for _ in range(rng.randint(1, 4)):
        for k, g in (("norm", rng.choice([6, 8])), ("norm", rng.choice([3, 4])), ("attn", rng.randint(2, 7)),
                     ("mlp", rng.randint(1, 12))):
            order.append((k, len(grids[k])))
            grids[k].append(g)
    order.append(("tail", 0))
    _simulate(grids, order, rng, pauses)


def test_pending_and_totals_on_a_hand_example() -> None:
    # three launches of one kernel with 4, 2, 4 blocks; block 3 skipped the last launch only, block 1 the last
    # two launches that have it (launches 1 and 2), block 0 nothing
    g = [4, 2, 4]
    assert v5_totals(g, 4) == [3, 3, 2, 2]
    assert v5_pending(g, [0, 2, 1, 1]) == [[], [1], [1, 2, 3]]
    assert v5_decide(MODE_RUN, 0, 0, 0) == (True, 0, 0)
    assert v5_decide(MODE_RUN, 1, 2, 0) == (False, 3, 0)
    assert v5_decide(MODE_RESUME, 0, 2, 3) == (False, 2, 2)  # done already (place 3 > 2 skipped)
    assert v5_decide(MODE_RESUME, 0, 2, 2) == (True, 1, 1)
    assert v5_decide(MODE_RESUME, 1, 2, 2) == (False, 2, 1)  # paused again: still pending
    assert v5_ctl_value(0x1000 + 64, 12) == 0x1000 + 64 + 12
    with pytest.raises(ValueError):
        v5_ctl_value(0x1000, 12)  # the header's own address is no region
    assert v5_align_log2(64) == 6 and v5_align_log2(65) == 7


@needs_ptxas
def test_stmatrix_before_the_first_barrier_no_longer_forces_an_entry_vote() -> None:
    """Inductor's RMSNorm+rope kernel of the Qwen3 layer at 8x512 (PTX from the H200) writes shared memory with
    stmatrix before its first barrier: protocol 4 (and protocol 5 without it) vote at entry; with
    ``stmatrix_sync=True`` (the default since session 11) at that barrier, after the kernel's loads, and it
    still assembles without spills."""
    from pathlib import Path

    (path,) = sorted((Path(__file__).parent / "data" / "h200" / "inductor-qwen3-ptx").glob("*cudnn*.ptx"))
    src = path.read_text().replace(".version 9.0", ".version 8.7")
    assert "stmatrix" in src
    k = rewrite_ptx(src).kernels[0].name
    assert rewrite_ptx(src, SafepointOptions(protocol=4)).kernel(k).vote_site == "entry"
    assert rewrite_ptx(src, SafepointOptions(**V5_BASE)).kernel(k).vote_site == "entry"
    assert rewrite_ptx(src).kernel(k).vote_site == "barrier"  # the default
    res = rewrite_ptx(src, SafepointOptions(stmatrix_sync=True))
    assert res.kernel(k).vote_site == "barrier"
    lines = _lines(res.ptx)
    stm = min(i for i, ln in enumerate(lines) if ln.startswith("stmatrix"))
    vote = next(i for i, ln in enumerate(lines) if ln.startswith(("barrier.red.or.pred", "bar.red.or.pred")))
    assert stm < vote
    a, plain = assemble(res.ptx), assemble(src)
    print(f"registers plain {plain.registers[k]} v5 {a.registers[k]}")
    assert a.spill_bytes.get(k, 0) == plain.spill_bytes.get(k, 0) == 0


# ---- the per-warp vote (SafepointOptions.warp_vote), run from the emitted PTX on a block of warps ------------

_WARP = SafepointOptions(warp_vote=True)


@needs_ptxas
def test_the_per_warp_vote_goes_where_the_inserted_barrier_was_and_waits_for_nothing_in_the_normal_path() -> None:
    src = ptx_of("poi_silu_mul")
    res = rewrite_ptx(src, _WARP)
    (rep,) = res.kernels
    assert rep.vote_site == "before_write" and rep.warp_vote
    lines = _lines(res.ptx)
    assert not any(ln.startswith(("barrier.red", "bar.red")) for ln in lines)  # no block-wide vote barrier
    hdr = [i for i, ln in enumerate(lines) if "ld.volatile.global.v2.u32 \t{%cft_r12, %cft_r13}" in ln]
    own = [i for i, ln in enumerate(lines) if re.match(r"(@%p\d+ )?ld\.global", ln) and "cft_" not in ln]
    stores = [i for i, ln in enumerate(lines) if "st.global" in ln and "%cft_" not in ln]
    arrive = [i for i, ln in enumerate(lines) if ln.startswith("barrier.arrive")]
    syncs = [i for i, ln in enumerate(lines) if ln.startswith("barrier.sync")]
    assert len(hdr) == 1 and lines[hdr[0]].startswith("@%cft_p3 ")  # every thread's read, armed launches only
    assert max(own) < hdr[0] < arrive[0] < stores[0]  # after the kernel's loads, decided before its first write
    assert len(arrive) == 1 and lines[arrive[0]] == "barrier.arrive \t1, 256" and len(syncs) == 2
    # the normal path from the header test: straight to the kernel's store, no barrier that waits
    normal = lines[arrive[0] - 12:arrive[0] + 2]
    assert normal[-1].startswith("bra.uni") and normal[-1].endswith("_novote")
    assert ".shared .align 4 .b32 cft_warps_poi_silu_mul_kernel[33];" in res.ptx[:res.ptx.index(".entry")]
    # every instruction of the kernel kept, in order (the barrier-1 lines are the vote's: the kernel has none)
    assert [ln for ln in _probe_free(res.ptx) if "barrier." not in ln] == _probe_free(src)
    plain, a = assemble(src), assemble(res.ptx)
    k = rep.name
    print(f"poi_silu_mul: registers plain {plain.registers[k]} default {assemble(rewrite_ptx(src).ptx).registers[k]} "
          f"warp vote {a.registers[k]}")
    assert a.spill_bytes.get(k, 0) == 0 and a.registers[k] <= plain.registers[k] + 8
    # where it cannot apply, the block vote stays: kernels with barriers, and a vote at entry or at a barrier
    for name in ("copy_then_reduce", "softmax", "layernorm", "atomic_sum"):
        r = rewrite_ptx(ptx_of(name), _WARP)
        assert not r.kernels[0].warp_vote and "cft_warps_" not in r.ptx
        assert r.ptx == rewrite_ptx(ptx_of(name)).ptx


def _warp_snippet() -> list[str]:
    """The per-warp vote as a thread meets it: the header read, then the site through its ``_novote`` label."""
    lines = _lines(rewrite_ptx(ptx_of("poi_silu_mul"), _WARP).ptx)
    h = next(i for i, ln in enumerate(lines) if ln.startswith("setp.ne.u64 \t%cft_p3, %cft_rd0, 0"))
    h_end = next(i for i in range(h, len(lines)) if "ld.volatile.global.v2.u32" in lines[i])
    v = next(i for i in range(h_end, len(lines)) if lines[i].startswith("setp.ne.u64 \t%cft_p1, %cft_rd0, 0"))
    v_end = next(i for i in range(v, len(lines)) if lines[i].endswith("_novote:"))
    return ["mov.u32 \t%cft_r12, 0", "mov.u32 \t%cft_r13, 0", *lines[h:h_end + 1], *lines[v:v_end + 1]]


def _run_block(code: list[str], ctl: int, mem: dict[int, int], header: int, views: list[tuple[int, int]],
               block: int, rng: random.Random) -> tuple[list[str], list[tuple[int, int]]]:
    """Run the snippet on one block of ``len(views)`` warps of 32 threads, interleaved at random one instruction
    at a time, with barrier 1, ``vote.sync`` and shared memory as the hardware has them; warp w reads the header
    as ``views[w]`` (pause, mode), as a pause landing between two warps' reads would make it. Returns each
    thread's outcome ("run": reached the site's end, "leave": returned) and the global stores, in order."""
    nw = len(views)
    n = 32 * nw
    labels = {ln[:-1]: i for i, ln in enumerate(code) if ln.endswith(":")}
    smem_sym = next(t for ln in code for t in re.split(r"[\s,;\[\]+]+", ln) if t.startswith("cft_warps_"))
    regs = [{"%cft_rd0": ctl} for _ in range(n)]
    pc = [0] * n
    out: list[str | None] = [None] * n
    waiting: dict[int, str] = {}  # thread -> "bar" or "vote:<pc>"
    arrived, bar_waiters = 0, []
    votes: dict[tuple[int, int], dict[int, bool]] = {}
    shared: dict[int, int] = {}
    stores: list[tuple[int, int]] = []
    SMEM = 0x400  # where the slots array sits in the shared window

    def val(t: int, tok: str) -> int:
        tok = tok.strip()
        special = {"%tid.x": t, "%tid.y": 0, "%tid.z": 0, "%ctaid.x": block, "%ctaid.y": 0, "%ctaid.z": 0,
                   "%nctaid.x": 64, "%nctaid.y": 1}
        if tok in special:
            return special[tok]
        if tok == smem_sym:
            return SMEM
        if tok.startswith("%"):
            return regs[t][tok]
        return int(tok, 0) & _M64

    def addr(t: int, tok: str) -> int:
        base, _, off = tok.strip()[1:-1].partition("+")
        return (val(t, base) + (int(off) if off else 0)) & _M64

    steps = 0
    while any(o is None for o in out):
        runnable = [t for t in range(n) if out[t] is None and t not in waiting]
        assert runnable, f"deadlock: {waiting}"
        t = rng.choice(runnable)
        steps += 1
        assert steps < 200_000
        if pc[t] >= len(code):
            out[t] = "run"
            continue
        ln = code[pc[t]]
        pc[t] += 1
        if ln.endswith(":"):
            continue
        guard = ""
        if ln.startswith("@"):
            guard, ln = ln.split(None, 1)
            g = guard[1:]
            if bool(regs[t][g.lstrip("!")]) != (not g.startswith("!")):
                continue
        op, _, rest = ln.partition(" ")
        ops = [x.strip() for x in re.split(r",(?![^{]*})", rest.strip())] if rest.strip() else []
        w = t // 32
        if op == "ret":
            out[t] = "leave"
        elif op.startswith("bra"):
            pc[t] = labels[ops[0]]
        elif op == "vote.sync.any.pred":
            assert ops[2] == "-1"
            key = (w, pc[t])
            votes.setdefault(key, {})[t] = bool(regs[t][ops[1]])
            waiting[t] = f"vote:{pc[t]}"
            if len(votes[key]) == 32:  # every lane of the warp is at this vote
                anyv = any(votes[key].values())
                for lt in votes.pop(key):
                    regs[lt][ops[0]] = int(anyv)
                    del waiting[lt]
        elif op in ("barrier.arrive", "barrier.sync"):
            assert ops == ["1", str(n)], ops
            arrived += 1
            if op == "barrier.sync":
                waiting[t] = "bar"
                bar_waiters.append(t)
            if arrived == n:  # the barrier completes: its waiters go on, it is ready for the next use
                for bt in bar_waiters:
                    del waiting[bt]
                arrived, bar_waiters = 0, []
        elif op == "ld.volatile.global.v2.u32":
            a = addr(t, ops[1])
            d = [x.strip() for x in ops[0].strip("{}").split(",")]
            lo, hi = (views[w] if a == header else (mem.get(a, 0), mem.get(a + 4, 0)))
            regs[t][d[0]], regs[t][d[1]] = lo, hi
        elif op == "st.volatile.global.v2.u32":
            a = addr(t, ops[0])
            s_ = [x.strip() for x in ops[1].strip("{}").split(",")]
            for aa, v in ((a, val(t, s_[0])), (a + 4, val(t, s_[1]))):
                mem[aa] = v & _M32
                stores.append((aa, v & _M32))
        elif op == "st.volatile.global.u32":
            a = addr(t, ops[0])
            mem[a] = val(t, ops[1]) & _M32
            stores.append((a, mem[a]))
        elif op == "st.shared.u32":
            shared[addr(t, ops[0])] = val(t, ops[1]) & _M32
        elif op == "ld.shared.u32":
            a = addr(t, ops[1])
            assert a in shared, f"thread {t} read shared {a:#x} before any warp wrote it"
            regs[t][ops[0]] = shared[a]
        else:
            _alu(op, ops, lambda tok, t=t: val(t, tok), regs[t])
    assert not waiting and arrived == 0  # nobody left inside the barrier or a vote
    return [o for o in out if o is not None], stores


@needs_ptxas
@given(st.integers(MODE_RUN, MODE_RESUME), st.lists(st.integers(0, 1), min_size=8, max_size=8),
       st.integers(0, 5), st.integers(0, 6), st.integers(0, 63), st.integers(0, 10_000), st.booleans())
@settings(max_examples=60, deadline=None)
def test_the_per_warp_vote_gives_every_block_one_outcome_and_the_block_votes_record(
        mode: int, pauses: list[int], s: int, rem: int, block: int, seed: int, armed: bool) -> None:
    code = _warp_snippet()
    nw = 8  # poi_silu_mul: .reqntid 256
    align = v5_align_log2(HDR_BYTES + REC_BYTES * 64)
    base = (0x7F1234567000 >> align) << align
    region = base + HDR_BYTES
    rec = region + REC_BYTES * block
    mem = {rec: s, rec + 4: rem}
    views = [(p, mode) for p in pauses[:nw]]  # each warp's read of (pause, mode): the pause may land between them
    outs, stores = _run_block(code, v5_ctl_value(region, align) if armed else 0, mem, base, views, block,
                              random.Random(seed))
    assert len(set(outs)) == 1, "the block's warps disagree"  # one outcome for the whole block
    if not armed:
        assert outs[0] == "run" and stores == []
        return
    if mode == MODE_RUN and 0 in pauses[:nw]:  # a warp passed the vote: the block runs whole, unrecorded
        assert outs[0] == "run" and stores == []
        return
    runs, s2, rem2 = v5_decide(mode, views[0][0], s, rem)  # every warp waited: the leader's decision (warp 0)
    assert outs[0] == ("run" if runs else "leave")
    assert (mem[rec], mem[rec + 4]) == (s2, rem2) and all(a in (rec, rec + 4) for a, _ in stores)
