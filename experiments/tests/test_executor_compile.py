"""CPU CI: the executor image renders from executor/ring.py's constants and NVRTC-compiles for sm_90 (no GPU)."""

from __future__ import annotations

import re

import pytest

from concordia_ft.core.regions import RegionKind
from concordia_ft.errors import ConfigError
from concordia_lab.executor import resident as E
from concordia_lab.executor import ring as R


def defines(src: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (CCR_\w+) (\d+)u?$", src, re.M)}


def test_render_carries_the_ring_layout() -> None:
    d = defines(E.render_executor_source(image_id=7, threads=128))
    assert d["CCR_IMAGE_ID"] == 7 and d["CCR_THREADS"] == 128 and d["CCR_MAX_REGS"] == 0
    offsets = {k: v for k, v in vars(R).items() if k.startswith("OFF_")}
    assert offsets and all(d[f"CCR_{k}"] == v for k, v in offsets.items())
    assert "CCR_OFF_HEAD" not in d  # protocol version 2 has no head word
    assert d["CCR_SLOTS_OFF"] == R.CTRL_BYTES and d["CCR_SLOT_BYTES"] == R.SLOT_BYTES
    assert (d["CCR_MAGIC"], d["CCR_VERSION"]) == (R.MAGIC, R.VERSION) == (R.MAGIC, 2)
    assert (d["CCR_TAG_SHIFT"], d["CCR_TAG_MARK"], d["CCR_TAG_SEQ_MASK"]) == (R.TAG_SHIFT, R.TAG_MARK, R.TAG_SEQ_MASK)
    for op in R.Opcode:
        assert d[f"CCR_OP_{op.name}"] == int(op)
    for s in R.ConsumerState:
        assert d[f"CCR_STATE_{s.name}"] == int(s)
    for e in R.ConsumerError:
        assert d[f"CCR_ERR_{e.name}"] == int(e)
    # the batch read (32 lanes x 8 bytes) must be whole slots
    assert d["CCR_BATCH"] * R.SLOT_BYTES == 32 * 8


@pytest.mark.parametrize("bad", [dict(threads=100), dict(threads=2048), dict(image_id=0)])
def test_render_rejects_bad_options(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        E.render_executor_source(**bad)


def test_nvrtc_compiles_every_kernel_for_sm90(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cuda.bindings.nvrtc")
    monkeypatch.setenv("CONCORDIA_CACHE_DIR", str(tmp_path))
    one = E.compile_executor(image_id=1)
    two = E.compile_executor(image_id=2)
    assert one.cubin.startswith(b"\x7fELF") and not one.cache_hit
    for name in (b"concordia_executor", b"concordia_exec_wide", b"concordia_exec_wide_at"):
        assert name in one.cubin
    assert one.key != two.key  # a new image is a new module (hot-swap loads it beside nothing)
    again = E.compile_executor(image_id=1)
    assert again.cache_hit and again.cubin == one.cubin


def _ptx_of(source: str, function: str) -> str:
    """PTX of one kernel (NVRTC, compute_90): what ptxas turns into the poll loop's loads and fences."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    prog = nvrtc.nvrtcCreateProgram(source.encode(), b"executor.cu", 0, [], [])[1]
    try:
        opts = [b"-arch=compute_90", b"-std=c++17", b"-default-device"]
        assert nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
        buf = b" " * int(nvrtc.nvrtcGetPTXSize(prog)[1])
        nvrtc.nvrtcGetPTX(prog, buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    ptx = buf.rstrip(b"\0 ").decode()
    start = ptx.index(f".entry {function}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end > 0 else len(ptx)]


def test_resident_poll_is_one_round_trip_and_one_fence_per_task() -> None:
    """The poll loads the slot words with ONE acquire per lane (a second acquire in a lane would start only
    after the first returned: two PCIe round trips) and stop with a relaxed load; a task costs one
    system-scope acq_rel fence (the heartbeat is relaxed: no fence inside the poll)."""
    ptx = _ptx_of(E.render_executor_source(image_id=1), "concordia_executor")
    assert len(re.findall(r"ld\.acquire\.sys", ptx)) == 1, re.findall(r"ld\.\w+\.sys[.\w]*", ptx)
    assert len(re.findall(r"ld\.relaxed\.sys\.global\.u32", ptx)) == 1  # stop
    assert len(re.findall(r"fence\.acq_rel\.sys", ptx)) == 1
    assert "st.release.sys.global.u64" not in ptx  # tail, result seq and heartbeat follow the one fence


def test_cyclic_comparison_and_grid_policy() -> None:
    assert E.cyclic_reached(5, 5) and E.cyclic_reached(6, 5) and not E.cyclic_reached(4, 5)
    assert E.cyclic_reached(2, 0xFFFFFFFE)  # wrapped: 2 is "after" 0xfffffffe
    assert not E.cyclic_reached(0xFFFFFFFF, 2)
    assert E.wide_grid(132, R.Opcode.ADD, 64) == 1
    assert E.wide_grid(132, R.Opcode.ADD, 1 << 30) == 4 * 132
    assert E.wide_grid(132, R.Opcode.PAGE_DIFF, 65536) == 4 * 132


def test_choose_path() -> None:
    assert E.choose_path(RegionKind.PAGED, 1 << 30) == "resident"
    assert E.choose_path("opaque", 256 << 20) == "launch"
    assert E.choose_path("opaque", 256 << 20, prefer_armed=True) == "armed"
    assert E.choose_path("opaque", 256 << 20, recurring=False, prefer_armed=True) == "launch"
    assert E.choose_path("dense", 4096) == "resident"
    assert E.choose_path("dense", 1 << 20) == "launch"
    assert E.choose_path("scratch", 1 << 30) == "none"
