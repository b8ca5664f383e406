"""CPU CI: the GPU pause trigger's kernels (instrument/pause.py TRIGGER_SOURCE) compile with NVRTC for the H200
and export the entry points GpuPauseTrigger launches (protocol 4: counting done bits; 5: watching outputs);
ptxas's resource report shows they spill nothing. Their behaviour on a running launch is tested on the H200 (tests/gpu/test_instrument_pause_gpu.py)."""

from __future__ import annotations

import ctypes

import pytest

from concordia_ft.errors import CompileError
from concordia_lab.instrument import interposer as ip
from concordia_lab.instrument.pause import TRIGGER_SOURCE

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings not installed")

from concordia_ft.cuda import nvrtc  # noqa: E402


def test_the_trigger_compiles_for_sm90_and_exports_its_entry() -> None:
    mod = nvrtc.compile_cubin(TRIGGER_SOURCE, "cft_pause_trigger", nvrtc.CompileOptions(arch="sm_90"))
    try:
        lib = ip.load(ip.build())
    except CompileError as e:  # pragma: no cover
        pytest.skip(f"interposer does not build here: {e}")
    names: list[str] = []
    cb = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p)(lambda n, _: names.append(n.decode()))
    buf = ctypes.create_string_buffer(mod.cubin, len(mod.cubin))
    lib.cft_elf_kernels.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p]
    assert lib.cft_elf_kernels(buf, len(mod.cubin), cb, None) == 2
    assert sorted(names) == ["cft_pause_after_blocks", "cft_pause_after_writes"]  # v4 done bits, v5 outputs
