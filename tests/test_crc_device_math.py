"""CPU CI: the arithmetic of the GPU CRC32C (cuda/crc.py) against the ``crc32c`` package on random data.

The kernels split a piece into spans of a front-zero-padded tile grid, take each span's raw CRC, combine the
spans of a tile in a tree and fold the tiles with the GF(2) shift; the host turns the raw CRC into the standard
one. ``reference_tiled_raw`` is that decomposition in Python: it must give crc32c of the piece for every length
(empty, shorter than a span, not a multiple of a tile) and for other span/tile shapes. The kernel source must
compile with NVRTC (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

crc32c_pkg = pytest.importorskip("crc32c")

from concordia_ft.core.checksums import crc32c_combine, raw_crc, raw_to_crc32c  # noqa: E402
from concordia_ft.cuda import crc  # noqa: E402


@pytest.mark.parametrize("n", [0, 1, 3, 8, 255, 256, 257, 4096 + 5, crc.TILE - 1, crc.TILE, crc.TILE + 1,
                               2 * crc.TILE + 12345])
def test_the_tiled_decomposition_gives_crc32c(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    raw = crc.reference_tiled_raw(data)
    assert raw == raw_crc(data)
    assert raw_to_crc32c(raw, n) == crc32c_pkg.crc32c(data)


@pytest.mark.parametrize(("span", "threads"), [(8, 2), (16, 8), (24, 4), (64, 32)])
def test_other_span_and_tile_shapes_give_crc32c_too(span: int, threads: int) -> None:
    rng = np.random.default_rng(span * threads)
    for n in [0, 1, span - 1, span, span * threads, span * threads * 3 + 7, int(rng.integers(1, 5000))]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert raw_to_crc32c(crc.reference_tiled_raw(data, span, threads), n) == crc32c_pkg.crc32c(data)


def test_raw_crcs_combine_like_standard_ones_and_a_flipped_byte_changes_the_result() -> None:
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    b = rng.integers(0, 256, 777, dtype=np.uint8).tobytes()
    whole = crc32c_pkg.crc32c(a + b)
    assert crc32c_combine(crc32c_pkg.crc32c(a), crc32c_pkg.crc32c(b), len(b)) == whole
    # raw(A || B) = x^(8|B|) raw(A) + raw(B): the same combine, no conditioning
    assert crc32c_combine(raw_crc(a), raw_crc(b), len(b)) == raw_crc(a + b)
    flipped = bytearray(a + b)
    flipped[1234] ^= 0x04
    assert raw_to_crc32c(crc.reference_tiled_raw(bytes(flipped), 16, 8), len(flipped)) != whole


def test_the_kernels_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings not installed")
    monkeypatch.setenv("CONCORDIA_CACHE_DIR", str(tmp_path / "cache"))
    m = crc.compile_crc("sm_90")
    assert m.cubin[:4] == b"\x7fELF"
    assert b"concordia_crc32c_tiles" in m.cubin and b"concordia_crc32c_pieces" in m.cubin
