"""A CPU stand-in for graph decode's GPU side: an arena whose rows a 'step' writes, and a ring of host slots
filled exactly as cuda/graphs.py's kernel fills them (pages, then header words, sequence word last). Used by
tests/test_slotlog.py and its SIGKILL child (run as a script: ``slotlog_helpers.py child LOG BACKEND N``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.core.tracking import RegionDelta

SLOT_HEADER = 4096
PAGE = 4096
TOK_PAGE = 512
ROW_BYTES = 6 * 4096 + 1000  # not a whole number of pages: rows straddle, as SmolLM2's do
N_ROWS = 200


def specs() -> tuple[RegionSpec, RegionSpec]:
    kv = RegionSpec("kv", RegionKind.PAGED, -(-N_ROWS * ROW_BYTES // PAGE) * PAGE, PAGE, block_bytes=PAGE)
    tok = RegionSpec("tokens", RegionKind.PAGED, 4 * TOK_PAGE, TOK_PAGE, block_bytes=TOK_PAGE)
    return kv, tok


def max_pages() -> int:
    return -(-ROW_BYTES // PAGE) + (1 if ROW_BYTES % PAGE else 0)


class FakeRing:
    """``n_slots`` slots in page-aligned host memory; ``fill(seq, row, token)`` is the kernel's work."""

    def __init__(self, n_slots: int, arena: np.ndarray) -> None:
        self.n_slots = n_slots
        self.slot_bytes = SLOT_HEADER + max_pages() * PAGE
        raw = np.zeros(n_slots * self.slot_bytes + PAGE, np.uint8)
        off = (-raw.ctypes.data) % PAGE
        self.buf = raw[off: off + n_slots * self.slot_bytes]
        self._raw = raw
        self.arena = arena

    @property
    def address(self) -> int:
        return int(self.buf.ctypes.data)

    def fill(self, seq: int, row: int, token: int) -> tuple[int, int]:
        lo = row * ROW_BYTES
        p0, p1 = lo // PAGE, -(-(lo + ROW_BYTES) // PAGE)
        base = (seq % self.n_slots) * self.slot_bytes
        n = (p1 - p0) * PAGE
        self.buf[base + SLOT_HEADER: base + SLOT_HEADER + n] = self.arena[p0 * PAGE: p1 * PAGE]
        words = self.buf[base: base + 40].view(np.int64)
        words[1:5] = (token, row, p0, p1 - p0)
        words[0] = seq + 1
        return p0, p1 - p0


def row_bytes(row: int) -> np.ndarray:
    """What the model's step writes into row ``row`` (random bytes, a function of the row)."""
    return np.random.default_rng(7919 + row).integers(0, 256, ROW_BYTES, dtype=np.uint8)


def step(arena: np.ndarray, row: int) -> None:
    arena[row * ROW_BYTES: (row + 1) * ROW_BYTES] = row_bytes(row)


def meta(n_tokens: int, n_new: int, done: bool, length: int, *, t: Any = 1.5) -> dict[str, Any]:
    """Session-like metadata; ``t`` a fixed time (byte-comparable) or a sentinel."""
    return {"session": {"n_tokens": n_tokens, "cache_lengths": [length] * 3, "name": "x\"y", "t": t,
                        "gen": {"n_new": n_new, "done": done, "start": 4}}}


def reference_deltas(kv: RegionSpec, tok: RegionSpec, ring: FakeRing, seq: int, image: np.ndarray,
                     n_tokens: int) -> list[RegionDelta]:
    """What graph_decode's Python writer appends for step ``seq`` (checkpoint_every=1)."""
    base = (seq % ring.n_slots) * ring.slot_bytes
    w = ring.buf[base: base + 40].view(np.int64)
    token, _row, p0, n = (int(x) for x in w[1:5])
    idx = n_tokens - 1
    image[idx] = token
    pages = np.arange(p0, p0 + n, dtype=np.int64)
    payload = memoryview(ring.buf[base + SLOT_HEADER: base + SLOT_HEADER + n * PAGE].copy())
    t0, t1 = idx * 8 // TOK_PAGE, -(-n_tokens * 8 // TOK_PAGE)
    tview = memoryview(image.view(np.uint8)[t0 * TOK_PAGE: t1 * TOK_PAGE].copy())
    return [RegionDelta(kv, pages, payload), RegionDelta(tok, np.arange(t0, t1, dtype=np.int64), tview)]


def child(log_dir: str, backend: str, n: int) -> None:
    """Append epochs through the C writer until killed; print each committed step (after its wait)."""
    from concordia_ft.core import slotlog
    from concordia_ft.core.log import RecoveryLog
    from concordia_ft.core.replay import replay

    kv, tok = specs()
    opts = {"backend": backend, "fsync": "always", "mapped_segment_bytes": 1 << 20}
    log = RecoveryLog.open(log_dir, opts)
    first = log.last_epoch is None
    if first:
        log.append(defs=[kv, tok])
        arena = np.zeros(kv.nbytes, np.uint8)
        image = np.zeros(tok.nbytes // 8, np.int64)
        start = 0
    else:  # continue from what replayed
        r = replay(Path(log_dir))
        arena = r.regions["kv"].data.copy()
        image = r.regions["tokens"].data.view(np.int64).copy()
        start = int(r.meta["session"]["n_tokens"])
    ring = FakeRing(6, arena)
    tmpl = slotlog.meta_template(meta(slotlog.SENTINELS[0], slotlog.SENTINELS[1], slotlog.SENTINELS[2],  # type: ignore[arg-type]
                                      slotlog.SENTINELS[3], t=slotlog.SENTINELS[4]), {0: 1, 1: 1, 2: 1, 3: 3, 4: 1})
    assert tmpl is not None
    w = slotlog.SlotLogWriter(log, ring_address=ring.address, n_slots=ring.n_slots, slot_bytes=ring.slot_bytes,
                              slot_header=SLOT_HEADER, max_pages=max_pages(), kv=kv, tokens_image=image, tokens=tok,
                              meta=tmpl)
    print("OPEN", start, flush=True)
    for i in range(n):
        row = start + i
        if row >= N_ROWS or row + 1 > image.size:
            break
        if i >= ring.n_slots:
            w.wait(i - ring.n_slots)
        step(arena, row)
        ring.fill(i, row, 1000 + row)
        w.submit(i, row + 1, row + 1, False)
        if i >= 1:
            w.wait(i - 1)
            print("COMMITTED", row, flush=True)  # n_tokens = row of step i-1 + 1 = row
    w.stop()
    log.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
