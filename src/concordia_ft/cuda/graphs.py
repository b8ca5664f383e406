"""The per-token epoch, issued by the GPU: a kernel captured in the decode step's CUDA graph.

After the model's step wrote the KV row of the token it fed (row ``*pos`` of the arena's full section) and
sampled the next token (``*tok``), ``concordia_token_epoch`` copies the arena pages that row covers into slot
``*seq % n_slots`` of a ring of host-mapped pinned slots, then writes the slot's header, and the sequence word
(``*seq + 1``) last, after a system-scope fence. The positions, the token and the counter are device tensors the
graph itself advances, so a replay needs no host launch and no host argument: the host only replays the graph
and, later, reads slots (a background writer appends them to the log).

Slot layout (``SLOT_HEADER`` bytes of header, then the pages, page-aligned):

    int64 [0] seq + 1   written last (0: never filled)
    int64 [1] token     the token sampled by this step
    int64 [2] row       the KV row written by this step (= the position of the token fed)
    int64 [3] page0     the first arena page copied
    int64 [4] n_pages   how many pages follow the header (0 when built ``with_pages=False``: the token only,
                        what a plain graph decode without epochs still has to get to the host)

Many blocks copy; the last block to finish (a ticket counter in device memory, reset by that block for the next
replay) publishes the header. Pinned host memory is written with plain 16-byte stores over PCIe; with unified
addressing its device address is its host address (DESIGN.md §3).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import driver
from .memory import DeviceBuffer, PinnedBuffer

SLOT_HEADER = 4096
KERNEL = "concordia_token_epoch"
THREADS = 256
MAX_BLOCKS = 64

SOURCE = r"""
extern "C" __global__ void concordia_token_epoch(
    const unsigned char* __restrict__ arena, unsigned long long section_start, unsigned long long row_bytes,
    unsigned long long page_bytes, const long long* __restrict__ pos, const long long* __restrict__ tok,
    const long long* __restrict__ seq, unsigned char* ring, unsigned long long slot_bytes, unsigned int n_slots,
    unsigned int* ticket, unsigned int with_pages)
{
    const long long row = *pos;
    const long long s = *seq;
    const unsigned long long lo = section_start + (unsigned long long)row * row_bytes;
    const unsigned long long p0 = lo / page_bytes;
    const unsigned long long p1 = (lo + row_bytes + page_bytes - 1) / page_bytes;
    const unsigned long long n16 = with_pages ? (p1 - p0) * page_bytes / 16 : 0ull;
    unsigned char* slot = ring + (unsigned long long)(s % n_slots) * slot_bytes;
    const uint4* src = reinterpret_cast<const uint4*>(arena + p0 * page_bytes);
    uint4* dst = reinterpret_cast<uint4*>(slot + 4096);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int t = atomicAdd(ticket, 1u);
        if (t == gridDim.x - 1) {  // every other block's stores are fenced: publish
            *ticket = 0u;
            volatile long long* h = reinterpret_cast<volatile long long*>(slot);
            h[1] = *tok;
            h[2] = row;
            h[3] = (long long)p0;
            h[4] = with_pages ? (long long)(p1 - p0) : 0ll;
            __threadfence_system();
            h[0] = s + 1;
        }
    }
}
"""


def compile_token_epoch(arch: str = "sm_90") -> Any:
    """The kernel's cubin (NVRTC; no GPU needed)."""
    from .nvrtc import CompileOptions, compile_cubin

    return compile_cubin(SOURCE, "token_epoch", CompileOptions(arch=arch))


@dataclass(frozen=True)
class SlotRecord:
    seq: int
    token: int
    row: int
    page0: int
    n_pages: int
    payload: memoryview  # the pages, in the pinned slot (valid until the slot is reused)


class TokenRing:
    """``n_slots`` host-mapped pinned slots of ``SLOT_HEADER + max_pages * page_bytes`` bytes each."""

    def __init__(self, n_slots: int, max_pages: int, page_bytes: int) -> None:
        self.n_slots, self.max_pages, self.page_bytes = int(n_slots), int(max_pages), int(page_bytes)
        self.slot_bytes = SLOT_HEADER + self.max_pages * self.page_bytes
        self.buf = PinnedBuffer(self.n_slots * self.slot_bytes)
        ctypes.memset(self.buf.host_ptr, 0, self.buf.nbytes)
        self._view = self.buf.view()
        self._words: npt.NDArray[np.int64] = self.buf.numpy(np.int64)

    @property
    def device_ptr(self) -> int:
        return self.buf.device_ptr

    @property
    def host_ptr(self) -> int:
        """The slots' host address (the C writer reads them there, core/slotlog.py)."""
        return self.buf.host_ptr

    def read(self, seq: int) -> SlotRecord | None:
        """The record of step ``seq`` (None when the slot does not hold it: not written yet, or overwritten)."""
        base = (seq % self.n_slots) * self.slot_bytes
        w = self._words[base // 8: base // 8 + 5]
        if int(w[0]) != seq + 1:
            return None
        n = int(w[4])
        if not 0 <= n <= self.max_pages:
            return None
        payload = self._view[base + SLOT_HEADER: base + SLOT_HEADER + n * self.page_bytes]
        return SlotRecord(seq, int(w[1]), int(w[2]), int(w[3]), n, payload)

    def close(self) -> None:
        self._view.release()
        self.buf.close()


class TokenEpochKernel:
    """The loaded kernel with its arguments packed once (every argument is a fixed device address)."""

    def __init__(self, *, arena_ptr: int, section_start: int, row_bytes: int, page_bytes: int, pos_ptr: int,
                 tok_ptr: int, seq_ptr: int, ring: TokenRing, device: int, with_pages: bool = True) -> None:
        from .nvrtc import load_module

        if page_bytes % 16 or arena_ptr % 16:
            raise ValueError("the arena and its pages must be 16-byte aligned")
        self.device = driver.ensure_context(device)
        self.module = load_module(SOURCE, "token_epoch", device=self.device)
        self.function = self.module.function(KERNEL)
        self.ticket = DeviceBuffer(16, zero=True)
        n16 = ring.max_pages * page_bytes // 16
        self.blocks = max(1, min(MAX_BLOCKS, -(-n16 // THREADS))) if with_pages else 1
        c = ctypes
        self.args = driver.KernelArgs([
            (c.c_uint64, arena_ptr), (c.c_uint64, section_start), (c.c_uint64, row_bytes), (c.c_uint64, page_bytes),
            (c.c_uint64, pos_ptr), (c.c_uint64, tok_ptr), (c.c_uint64, seq_ptr), (c.c_uint64, ring.device_ptr),
            (c.c_uint64, ring.slot_bytes), (c.c_uint32, ring.n_slots), (c.c_uint64, self.ticket.ptr),
            (c.c_uint32, 1 if with_pages else 0)])

    def launch(self, stream: driver.Stream) -> None:
        driver.launch(self.function, self.blocks, THREADS, self.args, stream, what=KERNEL)

    def close(self) -> None:
        self.ticket.close()
        self.module.close()


def max_row_pages(row_bytes: int, page_bytes: int) -> int:
    """The most pages one row can touch, wherever it starts (a row not a whole number of pages straddles)."""
    return -(-row_bytes // page_bytes) + (1 if row_bytes % page_bytes else 0)


__all__ = ["SLOT_HEADER", "SOURCE", "SlotRecord", "TokenEpochKernel", "TokenRing", "compile_token_epoch",
           "max_row_pages"]
