"""CRC32C on the GPU: the log's payload checksums run on the bytes after they reached the device.

A streamed restore (core/streamed.py) DMAs each chunk of a KV pool into place; the record checksums that the
log's open deferred (``RecoveryOptions.defer_verify``) then run here, on the device copies, instead of on the
host copy threads (which only memcpy). Two kernels, compiled with NVRTC like the other handlers:

- ``concordia_crc32c_tiles``: a block of ``THREADS`` threads checksums one **tile** (``TILE`` bytes) of a
  piece; each thread computes the *raw* CRC (register starting at 0, no final xor) of its ``SPAN`` bytes with
  slice-by-8 tables built in shared memory, then the block combines the 256 span CRCs in a tree.
- ``concordia_crc32c_pieces``: one thread per piece folds its tiles' raw CRCs in order.

The combine is the GF(2) one zlib uses for ``crc32_combine``: raw(A || B) = x^(8|B|) * raw(A) + raw(B) mod the
Castagnoli polynomial: ``gf2_multmodp`` of core/_crc32c_gf2.h, the C extension's copy (put in front of the
kernel source by ``render``), with its Python twin and the shift operators in core/checksums.py. Every span and tile is combined as if it were full-length: a piece of
``n`` bytes is treated as ``pad`` zero bytes followed by the piece (``pad`` making it a whole number of
tiles), and leading zeros do not change a raw CRC, so the shifts are the same powers of x for every piece and
no length-dependent operator is needed on the device. Alignment: a span's first and last bytes up to an
8-byte boundary are read one at a time, the rest as 8-byte words, so any address and any length work.

The host turns a piece's raw CRC into the standard CRC32C (``checksums.raw_to_crc32c``); the streamed restore
then combines
the pieces of a record (core/streamed.py) and compares with the record's stored checksum.
``reference_tiled_raw`` is the same decomposition in Python, checked against the ``crc32c`` package on CPU CI.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..core.checksums import crc32c_shift, multmodp, raw_crc, raw_to_crc32c
from . import driver, nvrtc

THREADS = 256
SPAN = 256  # bytes per thread
TILE = THREADS * SPAN  # bytes per block (64 KiB)
PIECE_THREADS = 128
GF2_HEADER = Path(__file__).resolve().parent.parent / "core" / "_crc32c_gf2.h"

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
__GF2__
#define THREADS __THREADS__
#define SPAN __SPAN__
#define TILE (THREADS * SPAN)

struct Piece { u64 ptr; u64 len; u64 tile0; u64 first_block; };

__device__ __forceinline__ void build_tables(u32 (*T)[256]) {
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = i;
#pragma unroll
        for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (CRC_POLY & (0u - (c & 1u)));
        T[0][i] = c;
    }
    __syncthreads();
    for (int t = 1; t < 8; ++t) {
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
            u32 c = T[t - 1][i];
            T[t][i] = (c >> 8) ^ T[0][c & 0xffu];
        }
        __syncthreads();
    }
}

__device__ __forceinline__ u32 raw_crc(u32 (*T)[256], const unsigned char* p, u64 n) {
    u32 c = 0;
    while (n && (((u64)p) & 7u)) { c = T[0][(c ^ *p) & 0xffu] ^ (c >> 8); ++p; --n; }
    const u64* w = (const u64*)p;
    for (; n >= 8; n -= 8) {
        u64 v = *w++;
        u32 lo = (u32)v ^ c, hi = (u32)(v >> 32);
        c = T[7][lo & 0xffu] ^ T[6][(lo >> 8) & 0xffu] ^ T[5][(lo >> 16) & 0xffu] ^ T[4][lo >> 24]
          ^ T[3][hi & 0xffu] ^ T[2][(hi >> 8) & 0xffu] ^ T[1][(hi >> 16) & 0xffu] ^ T[0][hi >> 24];
    }
    p = (const unsigned char*)w;
    while (n) { c = T[0][(c ^ *p) & 0xffu] ^ (c >> 8); ++p; --n; }
    return c;
}

// one block per tile; pieces[k].first_block: the launch's first block of piece k (ascending)
extern "C" __global__ void __launch_bounds__(THREADS)
concordia_crc32c_tiles(const Piece* __restrict__ pieces, u32 n_pieces, u32 x_span, u32* __restrict__ tile_crc) {
    __shared__ u32 T[8][256];
    __shared__ u32 red[THREADS];
    build_tables(T);
    u64 b = blockIdx.x;
    u32 lo = 0, hi = n_pieces;  // the last piece whose first_block <= b
    while (hi - lo > 1) { u32 mid = (lo + hi) >> 1; if (pieces[mid].first_block <= b) lo = mid; else hi = mid; }
    const Piece pc = pieces[lo];
    u64 t = b - pc.first_block;
    u64 ntiles = (pc.len + TILE - 1) / TILE;
    u64 pad = ntiles * TILE - pc.len;
    u64 vlo = t * TILE + (u64)threadIdx.x * SPAN, vhi = vlo + SPAN;
    u64 a = vlo > pad ? vlo - pad : 0, e = vhi > pad ? vhi - pad : 0;
    red[threadIdx.x] = raw_crc(T, (const unsigned char*)pc.ptr + a, e - a);
    __syncthreads();
    u32 sh = x_span;  // x^(8 * SPAN * s) at stride s
    for (u32 s = 1; s < THREADS; s <<= 1) {
        if ((threadIdx.x & (2 * s - 1)) == 0) red[threadIdx.x] = gf2_multmodp(sh, red[threadIdx.x]) ^ red[threadIdx.x + s];
        __syncthreads();
        sh = gf2_multmodp(sh, sh);
    }
    if (threadIdx.x == 0) tile_crc[pc.tile0 + t] = red[0];
}

// one thread per piece: its tiles' raw CRCs folded in order (each tile is TILE bytes: x_tile = x^(8 * TILE))
extern "C" __global__ void concordia_crc32c_pieces(const u64* __restrict__ tile0, const u32* __restrict__ ntiles,
                                                   u32 n, const u32* __restrict__ tile_crc, u32 x_tile,
                                                   u32* __restrict__ out) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32* c = tile_crc + tile0[i];
    u32 r = 0;
    for (u32 j = 0; j < ntiles[i]; ++j) r = gf2_multmodp(x_tile, r) ^ c[j];
    out[i] = r;
}
"""


def render() -> str:
    return (SOURCE.replace("__GF2__", GF2_HEADER.read_text()).replace("__THREADS__", str(THREADS))
            .replace("__SPAN__", str(SPAN)))


def compile_crc(arch: str = nvrtc.DEFAULT_ARCH) -> nvrtc.CompiledModule:
    return nvrtc.compile_cubin(render(), "concordia_crc32c", nvrtc.CompileOptions(arch=arch))


def tiles_of(nbytes: int) -> int:
    """Tiles (blocks of the tile kernel) a piece of ``nbytes`` takes; an empty piece takes none."""
    return -(-int(nbytes) // TILE)


X_SPAN = crc32c_shift(SPAN)
X_TILE = crc32c_shift(TILE)


def reference_tiled_raw(data: bytes | memoryview, span: int = SPAN, threads: int = THREADS) -> int:
    """What the two kernels compute for one piece, in Python: spans of a front-zero-padded piece, a tree per
    tile, tiles folded in order. Equals ``raw_crc(data)``."""
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    tile = span * threads
    nt = -(-n // tile)
    pad = nt * tile - n
    x_span = crc32c_shift(span)
    x_tile = crc32c_shift(tile)
    out = 0
    for t in range(nt):
        red = []
        for th in range(threads):
            vlo = t * tile + th * span
            a, e = max(0, vlo - pad), max(0, vlo + span - pad)
            red.append(raw_crc(mv[a:e]))
        sh, s = x_span, 1
        while s < threads:
            for i in range(0, threads, 2 * s):
                red[i] = multmodp(sh, red[i]) ^ red[i + s]
            sh = multmodp(sh, sh)
            s *= 2
        out = multmodp(x_tile, out) ^ red[0]
    return out


_U64, _U32 = ctypes.c_uint64, ctypes.c_uint32
PIECE_DTYPE = np.dtype([("ptr", "<u8"), ("len", "<u8"), ("tile0", "<u8"), ("first_block", "<u8")])


class DeviceCrc:
    """The loaded kernels on one device. ``tiles(pieces, n, tile_crc, stream)`` launches the tile kernel for
    ``n`` pieces described by a device array of ``PIECE_DTYPE``; ``pieces(...)`` folds them."""

    def __init__(self, device: int | None = None) -> None:
        self.device = driver.ensure_context(device)
        self.module = nvrtc.Module(compile_crc(driver.arch_of(self.device)), self.device)
        self.fn_tiles = self.module.function("concordia_crc32c_tiles")
        self.fn_pieces = self.module.function("concordia_crc32c_pieces")

    def tile_args(self, pieces_dev: int, tile_crc: int) -> driver.KernelArgs:
        """Arguments of the tile kernel for one piece table (argument 1, the piece count, is set per launch)."""
        return driver.KernelArgs([(_U64, pieces_dev), (_U32, 0), (_U32, X_SPAN), (_U64, tile_crc)])

    def launch_tiles(self, args: driver.KernelArgs, n_pieces: int, blocks: int, stream: driver.Stream) -> None:
        if blocks <= 0:
            return
        args.set(1, n_pieces)
        driver.launch(self.fn_tiles, blocks, THREADS, args, stream, what="concordia_crc32c_tiles")

    def tiles(self, pieces_dev: int, n_pieces: int, blocks: int, tile_crc: int, stream: driver.Stream) -> None:
        self.launch_tiles(self.tile_args(pieces_dev, tile_crc), n_pieces, blocks, stream)

    def pieces(self, tile0_dev: int, ntiles_dev: int, n: int, tile_crc: int, out_dev: int,
               stream: driver.Stream) -> None:
        if n <= 0:
            return
        args = driver.KernelArgs([(_U64, tile0_dev), (_U64, ntiles_dev), (_U32, n), (_U64, tile_crc),
                                  (_U32, X_TILE), (_U64, out_dev)])
        driver.launch(self.fn_pieces, -(-n // PIECE_THREADS), PIECE_THREADS, args, stream,
                      what="concordia_crc32c_pieces")

    def close(self) -> None:
        self.module.close()


_loaded: dict[int, DeviceCrc] = {}


def device_crc(device: int | None = None) -> DeviceCrc:
    """The kernels loaded on ``device`` (once per process and device)."""
    d = driver.ensure_context(device)
    m = _loaded.get(d)
    if m is None:
        m = _loaded[d] = DeviceCrc(d)
    return m


def crc32c_device(ranges: list[tuple[int, int]], *, device: int | None = None) -> list[int]:
    """Standard CRC32C of each ``(device pointer, nbytes)`` range, computed on the GPU (synchronous; tests
    and tools: the streamed restore batches its launches itself, cuda/streamed.py)."""
    import torch

    k = device_crc(device)
    stream = driver.Stream.from_torch(k.device)
    n = len(ranges)
    meta = np.zeros(n, dtype=PIECE_DTYPE)
    tiles = np.array([tiles_of(ln) for _, ln in ranges], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(tiles)[:-1]]) if n else np.zeros(0, np.int64)
    total = int(tiles.sum()) if n else 0
    for i, (p, ln) in enumerate(ranges):
        meta[i] = (p, ln, starts[i], starts[i])
    dev = torch.device("cuda", k.device)
    tile_crc = torch.zeros(max(1, total), dtype=torch.int32, device=dev)
    tile0 = torch.from_numpy(starts.astype(np.uint64).view(np.int64)).to(dev)
    ntiles = torch.from_numpy(tiles.astype(np.uint32).view(np.int32)).to(dev)
    out = torch.zeros(max(1, n), dtype=torch.int32, device=dev)
    nonempty = [i for i in range(n) if tiles[i] > 0]
    if nonempty:
        # empty pieces take no block: launch over the pieces that have tiles (first_block ascending)
        sub = torch.from_numpy(meta[nonempty].view(np.uint8)).to(dev)
        k.tiles(int(sub.data_ptr()), len(nonempty), total, int(tile_crc.data_ptr()), stream)
    k.pieces(int(tile0.data_ptr()), int(ntiles.data_ptr()), n, int(tile_crc.data_ptr()), int(out.data_ptr()),
             stream)
    raw = out[:n].cpu().numpy().view(np.uint32)
    return [raw_to_crc32c(int(r), ln) for r, (_, ln) in zip(raw, ranges, strict=True)]
