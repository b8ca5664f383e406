"""CPU CI: the interposer library builds with only a C compiler and wheel headers, and its image and ELF
readers are right on real cubins (ptxas output of real Triton PTX). The driver-side behaviour is tested on
the H200 (tests/gpu/test_instrument_interposer.py)."""

from __future__ import annotations

import ctypes
import struct

import pytest

from concordia_lab.errors import CompileError, InstrumentError
from concordia_lab.instrument import interposer as ip

try:
    LIB_PATH = ip.build()
except CompileError as e:  # pragma: no cover - only where the wheels' headers are missing
    pytest.skip(f"interposer does not build here: {e}", allow_module_level=True)

EMIT = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return ip.load(LIB_PATH)


def kernels_of(lib: ctypes.CDLL, image: bytes) -> tuple[int, list[str]]:
    names: list[str] = []
    cb = EMIT(lambda n, _ctx: names.append(n.decode()))
    buf = ctypes.create_string_buffer(image, len(image))
    n = lib.cft_elf_kernels(buf, ctypes.c_uint64(len(image)), cb, None)
    return n, names


def classify(lib: ctypes.CDLL, image: bytes) -> tuple[int, bool, bool]:
    ptx, sass = ctypes.c_int(9), ctypes.c_int(9)
    kind = lib.cft_classify_image(image, ctypes.byref(ptx), ctypes.byref(sass))
    return kind, bool(ptx.value), bool(sass.value)


def test_build_is_cached_and_exports_the_injection_entry_point() -> None:
    assert ip.build() == LIB_PATH
    syms = ctypes.CDLL(str(LIB_PATH))
    for s in ("InitializeInjection", "cft_start", "cft_snapshot", "cft_elf_kernels", "cft_classify_image"):
        assert hasattr(syms, s)


def test_kernel_names_come_from_the_cubin_symbol_table(lib: ctypes.CDLL) -> None:
    triton = pytest.importorskip("triton")
    del triton
    from concordia_lab.instrument.ptxas import assemble, find_ptxas

    if find_ptxas() is None:
        pytest.skip("no ptxas")
    from test_instrument_ptx import _TWO_KERNELS, ptx_of

    n, names = kernels_of(lib, assemble(_TWO_KERNELS).cubin)
    assert n == 3 and sorted(names) == ["first", "second", "third"]
    n, names = kernels_of(lib, assemble(ptx_of("matmul")).cubin)
    assert names == ["matmul_kernel"]
    bad = bytearray(assemble(_TWO_KERNELS).cubin)
    bad[0x28:0x30] = struct.pack("<Q", 1 << 40)  # section headers past the end
    assert kernels_of(lib, bytes(bad))[0] == -1
    assert kernels_of(lib, b"not an elf at all" * 8)[0] == -1


def _fatbin(entries: list[tuple[int, bytes]]) -> bytes:
    body = b""
    for kind, payload in entries:
        body += struct.pack("<HHIQ", kind, 0x101, 64, len(payload)) + b"\0" * 48 + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_loader_images_are_classified(lib: ctypes.CDLL) -> None:
    from concordia_lab.instrument.ptxas import assemble, find_ptxas

    if find_ptxas() is not None:
        from test_instrument_ptx import _TWO_KERNELS

        assert classify(lib, assemble(_TWO_KERNELS).cubin) == (1, False, True)
        assert classify(lib, _TWO_KERNELS.encode()) == (2, True, False)
    assert classify(lib, b"//\n// Generated\n.version 8.7\n") == (2, True, False)
    assert classify(lib, b"\x00\x01garbage" + b"\0" * 64) == (0, False, False)
    both = _fatbin([(2, b"\x7fELF" + b"\0" * 60), (1, b".version 8.7\n")])
    assert classify(lib, both) == (3, True, True)
    assert classify(lib, _fatbin([(2, b"\x7fELF" + b"\0" * 60)])) == (3, False, True)
    inner = ctypes.create_string_buffer(both, len(both))
    wrapper = struct.pack("<iiQQ", 0x466243B1, 1, ctypes.addressof(inner), 0)
    assert classify(lib, wrapper) == (3, True, True)


def test_not_started_is_a_clear_error(lib: ctypes.CDLL) -> None:
    snap = ip.snapshot(lib)
    assert snap["started"] is False and snap["launch_total"] == 0 and snap["modules"] == []
    assert snap["load_images"]["cuLibraryLoadData"] == {"unknown": 0, "cubin": 0, "ptx": 0, "fatbin": 0, "file": 0,
                                                        "with_ptx": 0}
    with pytest.raises(InstrumentError, match="not running"):
        ip.inventory(lib)


def test_child_env_points_the_driver_at_the_library() -> None:
    env = ip.child_env({"PATH": "/usr/bin"})
    assert env["CUDA_INJECTION64_PATH"] == str(LIB_PATH) and env["PATH"] == "/usr/bin"


def test_demangle_matches_the_profilers_names() -> None:
    m = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"
    assert ip.demangle(m).startswith("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor")
    assert ip.demangle("triton_poi_fused_add_0") == "triton_poi_fused_add_0"


def test_inventory_joins_modules_and_launches() -> None:
    snap = {"started": True, "launch_total": 5, "graph_launches": 1, "load_calls": {"cuModuleLoadData": 1},
            "modules": [{"id": 1, "bytes": 10, "api": "cuModuleLoadData", "image": "ptx", "ptx": True,
                         "kernels": ["a"]},
                        {"id": 2, "bytes": 20, "api": None, "image": "unknown", "ptx": False, "kernels": ["b", "c"]}],
            "launches": {"a": 2, "b": 3}}
    inv = ip.Inventory.from_snapshot(snap)
    assert inv.kernels["a"] == ip.KernelRecord("a", 1, True, 2)
    assert inv.kernels["c"].launches == 0 and inv.kernels["b"].module == 2 and not inv.kernels["b"].ptx
    s = inv.summary()
    assert s["kernels_launched"] == 2 and s["kernels_launched_from_ptx_images"] == 1 and s["modules_loaded_lazily"] == 1
    assert s["modules_by_loader"] == {"cuModuleLoadData": 1}
