"""Every CUDA handler against the numpy references and the CPU backend, on fresh random data.

Marker gpu (tests/gpu/conftest.py). Sizes include regions that are not a whole number of pages.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from concordia_ft.core.regions import DiffMode, RegionKind, RegionSpec  # noqa: E402
from concordia_ft.cpu.trackers import CpuTracker  # noqa: E402
from concordia_ft.cuda import driver  # noqa: E402
from concordia_ft.cuda.handlers import padded_pages, reference_dirty_pages, reference_page_hash  # noqa: E402
from concordia_ft.cuda.trackers import make_cuda_tracker  # noqa: E402

pytestmark = pytest.mark.gpu

GUARD = 4096  # bytes after the region inside the same allocation: must never be written

SIZES = [
    (37 * 4096 + 123, 4096),  # tail page of 123 bytes
    (1 << 20, 4096),
    (5000, 512),
    (3 * 65536 + 17, 65536),  # big pages, partial tail
    (64 << 20, 4096),  # many blocks: compaction across the whole grid
]


def _region(nbytes: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    host = rng.integers(0, 256, nbytes + GUARD, dtype=np.uint8)
    big = torch.from_numpy(host.copy()).cuda()
    return big, big[:nbytes], host


def _dirty(t: torch.Tensor, host: np.ndarray, nbytes: int, page_bytes: int, rng: np.random.Generator,
           n_pages_dirty: int) -> None:
    """Change random bytes in n random pages (only the region's real bytes), on the GPU and in ``host``."""
    n_pages = -(-nbytes // page_bytes)
    for p in rng.choice(n_pages, size=min(n_pages, n_pages_dirty), replace=False):
        lo, hi = p * page_bytes, min(nbytes, (p + 1) * page_bytes)
        pos = rng.integers(lo, hi, size=int(rng.integers(1, 4)))
        host[pos] ^= rng.integers(1, 256, size=len(pos), dtype=np.uint8)
    t.copy_(torch.from_numpy(host[:nbytes].copy()).cuda())
    torch.cuda.synchronize()


def _device_bytes(ptr: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint8)
    driver.check(driver.bindings().cuMemcpyDtoH(out.ctypes.data, ptr, n), "cuMemcpyDtoH")
    return out


@pytest.mark.parametrize("staging", ["mapped", "device"])
@pytest.mark.parametrize("mode", [DiffMode.HASH, DiffMode.SHADOW])
@pytest.mark.parametrize("nbytes,page_bytes", SIZES)
def test_opaque_matches_reference_and_cpu_backend(nbytes: int, page_bytes: int, mode: DiffMode, staging: str
                                                  ) -> None:
    rng = np.random.default_rng(nbytes * 7 + page_bytes + (mode is DiffMode.HASH))
    big, t, host = _region(nbytes, rng)
    spec = RegionSpec("r", RegionKind.OPAQUE, nbytes, page_bytes=page_bytes, diff=mode)
    tr = make_cuda_tracker(spec, t, staging=staging)
    cpu_buf = host[:nbytes].copy()
    cpu = CpuTracker(spec, cpu_buf)
    try:
        d0 = tr.collect(full=False)  # never advanced: a full base
        assert np.array_equal(d0.pages, np.arange(spec.n_pages))
        assert np.array_equal(np.frombuffer(d0.payload, np.uint8), padded_pages(host[:nbytes], page_bytes).ravel())
        tr.advance(d0)
        cpu.advance(cpu.collect(full=True))
        assert tr.collect(full=False).n_pages == 0
        for round_ in range(3):
            old = host[:nbytes].copy()
            _dirty(t, host, nbytes, page_bytes, rng, int(rng.integers(1, 40)))
            want = reference_dirty_pages(old, host[:nbytes], page_bytes)
            d = tr.collect(full=False)
            assert np.array_equal(d.pages, want), round_
            assert np.array_equal(np.frombuffer(d.payload, np.uint8).reshape(len(want), page_bytes),
                                  padded_pages(host[:nbytes], page_bytes)[want])
            cpu_buf[:] = host[:nbytes]
            dc = cpu.collect(full=False)
            assert np.array_equal(dc.pages, d.pages) and bytes(dc.payload) == bytes(d.payload)
            again = tr.collect(full=False)  # no advance yet: the same pages again
            assert np.array_equal(again.pages, want)
            tr.advance(again)
            cpu.advance(dc)
            assert tr.collect(full=False).n_pages == 0
            if mode is DiffMode.HASH:
                state = _device_bytes(tr._state.ptr, 8 * spec.n_pages).view(np.uint64)
                assert np.array_equal(state, reference_page_hash(host[:nbytes], page_bytes))
            else:
                assert np.array_equal(_device_bytes(tr._state.ptr, nbytes), host[:nbytes])
        assert np.array_equal(big[nbytes:].cpu().numpy(), host[nbytes:])  # guard untouched
        if mode is DiffMode.HASH:
            assert tr.device_state_bytes <= 0.002 * nbytes + 64 or nbytes < (1 << 20)
    finally:
        tr.close()


def test_hash_memory_is_under_0_2_percent_at_256_mib() -> None:
    nbytes = 256 << 20
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    tr = make_cuda_tracker(RegionSpec("r", RegionKind.OPAQUE, nbytes, diff=DiffMode.HASH), t)
    try:
        assert tr.device_state_bytes / nbytes <= 0.002, tr.device_state_bytes
    finally:
        tr.close()


@pytest.mark.parametrize("nbytes,page_bytes", SIZES[:4])
def test_restore_writes_exact_bytes_and_nothing_else(nbytes: int, page_bytes: int) -> None:
    rng = np.random.default_rng(nbytes + 1)
    src_host = rng.integers(0, 256, nbytes, dtype=np.uint8)
    spec = RegionSpec("r", RegionKind.OPAQUE, nbytes, page_bytes=page_bytes)
    big, t, host = _region(nbytes, rng)
    tr = make_cuda_tracker(spec, t)
    try:
        n_pages = spec.n_pages
        pages = np.sort(rng.choice(n_pages, size=max(1, n_pages // 2), replace=False)).astype(np.int64)
        pages = np.unique(np.concatenate([pages, [n_pages - 1]])).astype(np.int64)  # always the tail page
        payload = padded_pages(src_host, page_bytes)[pages].copy()
        payload[-1, nbytes - (n_pages - 1) * page_bytes:] = 0xAB  # padding must not be written
        tr.restore(pages, memoryview(payload.ravel()))
        got = big.cpu().numpy()
        want = host.copy()
        for p in pages:
            lo, hi = p * page_bytes, min(nbytes, (p + 1) * page_bytes)
            want[lo:hi] = src_host[lo:hi]
        assert np.array_equal(got, want)
        assert not tr.initialised  # the next epoch re-bases
    finally:
        tr.close()


@pytest.mark.parametrize("staging", ["mapped", "device"])
def test_paged_from_dirty_blocks(staging: str) -> None:
    rng = np.random.default_rng(3)
    block_bytes, n_blocks = 16384, 300
    nbytes = block_bytes * n_blocks
    spec = RegionSpec("kv", RegionKind.PAGED, nbytes, page_bytes=4096, block_bytes=block_bytes)
    big, t, host = _region(nbytes, rng)
    flags = torch.zeros(n_blocks, dtype=torch.uint8, device="cuda")
    tr = make_cuda_tracker(spec, t, dirty_blocks=flags, staging=staging)
    try:
        full = tr.collect(full=True)
        assert np.array_equal(np.frombuffer(full.payload, np.uint8), host[:nbytes])
        tr.advance(full)
        for _ in range(3):
            dirty = np.sort(rng.choice(n_blocks, size=int(rng.integers(1, 60)), replace=False))
            f = np.zeros(n_blocks, np.uint8)
            f[dirty] = rng.integers(1, 256, size=len(dirty))  # any nonzero flag is dirty
            flags.copy_(torch.from_numpy(f).cuda())
            _dirty(t, host, nbytes, 4096, rng, 0)
            d = tr.collect(full=False)
            want = (dirty[:, None] * 4 + np.arange(4)[None, :]).ravel()
            assert np.array_equal(d.pages, want)
            assert np.array_equal(np.frombuffer(d.payload, np.uint8).reshape(-1, 4096),
                                  host[:nbytes].reshape(-1, 4096)[want])
            other = rng.choice(np.setdiff1d(np.arange(n_blocks), dirty), size=5, replace=False)
            flags[torch.from_numpy(other).cuda()] = 1  # dirtied after collect: must survive advance
            tr.advance(d)
            torch.cuda.synchronize()
            assert np.array_equal(np.flatnonzero(flags.cpu().numpy()), np.sort(other))
            flags.zero_()
    finally:
        tr.close()


def test_dense_and_immutable() -> None:
    rng = np.random.default_rng(5)
    nbytes = 10 * 4096 + 9
    big, t, host = _region(nbytes, rng)
    dense = make_cuda_tracker(RegionSpec("d", RegionKind.DENSE, nbytes), t)
    imm = make_cuda_tracker(RegionSpec("i", RegionKind.IMMUTABLE, nbytes), t)
    try:
        for _ in range(2):
            _dirty(t, host, nbytes, 4096, rng, 2)
            d = dense.collect(full=False)
            assert d.n_pages == 11
            assert np.array_equal(np.frombuffer(d.payload, np.uint8), padded_pages(host[:nbytes], 4096).ravel())
            dense.advance(d)
        first = imm.collect(full=False)
        assert first.n_pages == 11
        imm.advance(first)
        _dirty(t, host, nbytes, 4096, rng, 3)
        assert imm.collect(full=False).n_pages == 0
        assert imm.collect(full=True).n_pages == 11
    finally:
        dense.close()
        imm.close()


def test_payload_is_pinned_host_memory() -> None:
    t = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device="cuda")
    tr = make_cuda_tracker(RegionSpec("r", RegionKind.OPAQUE, 1 << 16), t)
    try:
        d = tr.collect(full=True)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(d.payload))
        drv = driver.bindings()
        flags = driver.check(drv.cuMemHostGetFlags(addr), "cuMemHostGetFlags")  # raises for pageable memory
        assert int(flags) & int(drv.CU_MEMHOSTALLOC_DEVICEMAP)
    finally:
        tr.close()


def test_misaligned_or_cpu_tensor_is_refused() -> None:
    from concordia_ft.errors import RegionError

    t = torch.zeros(8192, dtype=torch.uint8, device="cuda")
    with pytest.raises(RegionError, match="16-byte"):
        make_cuda_tracker(RegionSpec("r", RegionKind.OPAQUE, 4096), t[3:4099])
    with pytest.raises(RegionError, match="CUDA tensor"):
        make_cuda_tracker(RegionSpec("r", RegionKind.OPAQUE, 4096), torch.zeros(4096, dtype=torch.uint8))
