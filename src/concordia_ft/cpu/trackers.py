"""The CPU reference backend: the Tracker contract over host memory, vectorised with numpy.

Every GPU handler is tested against these. No Python loop runs over pages: dirty detection is one
vectorised compare (shadow) or one vectorised hash per page (hash), gathers are fancy indexing.
``CpuDenseBatch`` stages every dense host region of an asynchronous epoch at once (core/tracking.py).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..core.regions import DiffMode, RegionKind, RegionSpec
from ..core.tracking import RegionDelta

_HASH_SEED = 0x9E3779B97F4A7C15


def _hash_keys(words_per_page: int) -> npt.NDArray[np.uint64]:
    rng = np.random.default_rng(0xC0DC0D1A)
    return rng.integers(1, 2**63, size=words_per_page, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def hash_pages(pages2d: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """A 64-bit hash per row of ``pages2d`` (rows of whole 8-byte words): sum of mixed words times odd keys.

    Any single changed word changes the hash (odd keys are invertible mod 2^64); several changes collide with
    probability about 2^-64 for unstructured data.
    """
    words = np.ascontiguousarray(pages2d).view(np.uint64)
    keys = _hash_keys(words.shape[1])
    with np.errstate(over="ignore"):
        mixed = words ^ (words >> np.uint64(29))
        h = (mixed * keys).sum(axis=1, dtype=np.uint64)
        return h ^ np.uint64(_HASH_SEED)


class CpuTracker:
    """Tracks one host region. ``buf`` is a writable 1-D uint8 view of the region's bytes."""

    def __init__(self, spec: RegionSpec, buf: npt.NDArray[np.uint8],
                 dirty_blocks: npt.NDArray[np.generic] | None = None, *, synced: bool = False) -> None:
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != spec.nbytes:
            raise AssertionError(f"tracker for {spec.name!r} needs a 1-D uint8 view of {spec.nbytes} bytes")
        if spec.kind is RegionKind.PAGED:
            if dirty_blocks is None or dirty_blocks.shape != (spec.n_blocks,):
                shape = None if dirty_blocks is None else dirty_blocks.shape
                raise ValueError(f"paged region {spec.name!r} needs a dirty-block bitmap of shape "
                                 f"({spec.n_blocks},), got {shape}")
        self.spec = spec
        self.buf = buf
        self.dirty_blocks = dirty_blocks
        self._full_pages = spec.nbytes // spec.page_bytes
        self._shadow: npt.NDArray[np.uint8] | None = None
        self._hashes: npt.NDArray[np.uint64] | None = None
        self._pending_hashes: npt.NDArray[np.uint64] | None = None
        self._synced = synced  # the log holds this region's current baseline (or it needs none: paged)

    # ------------------------------------------------------------------------------------------ helpers
    def _main(self) -> npt.NDArray[np.uint8]:
        pb = self.spec.page_bytes
        return self.buf[: self._full_pages * pb].reshape(self._full_pages, pb)

    def _tail(self) -> npt.NDArray[np.uint8]:
        return self.buf[self._full_pages * self.spec.page_bytes :]

    def gather(self, pages: npt.NDArray[np.int64]) -> memoryview:
        """Copy ``pages`` into one staging buffer (the tail page zero-padded). Whole region: zero-copy."""
        pb = self.spec.page_bytes
        n = len(pages)
        if n == self.spec.n_pages and self._full_pages == n:
            return memoryview(self.buf).cast("B")
        out = np.empty((n, pb), dtype=np.uint8)
        has_tail = n and int(pages[-1]) == self._full_pages  # ascending: the tail page can only be last
        body = pages[:-1] if has_tail else pages
        if len(body):
            if int(body[-1]) - int(body[0]) + 1 == len(body):
                out[: len(body)] = self._main()[int(body[0]) : int(body[-1]) + 1]
            else:
                np.take(self._main(), body, axis=0, out=out[: len(body)])
        if has_tail:
            tail = self._tail()
            out[-1, : len(tail)] = tail
            out[-1, len(tail) :] = 0
        return memoryview(out.reshape(-1)).cast("B")

    def _page_hashes(self) -> npt.NDArray[np.uint64]:
        pb = self.spec.page_bytes
        h = hash_pages(self._main()) if self._full_pages else np.zeros(0, dtype=np.uint64)
        if self._full_pages < self.spec.n_pages:
            last = np.zeros((1, pb), dtype=np.uint8)
            tail = self._tail()
            last[0, : len(tail)] = tail
            h = np.concatenate([h, hash_pages(last)])
        return h

    def _dirty_pages(self) -> npt.NDArray[np.int64]:
        kind = self.spec.kind
        if kind is RegionKind.DENSE:
            return np.arange(self.spec.n_pages, dtype=np.int64)
        if kind is RegionKind.IMMUTABLE:
            return np.zeros(0, dtype=np.int64)
        if kind is RegionKind.PAGED:
            assert self.dirty_blocks is not None
            blocks = np.flatnonzero(self.dirty_blocks).astype(np.int64)
            ppb = self.spec.pages_per_block
            return (blocks[:, None] * ppb + np.arange(ppb, dtype=np.int64)).reshape(-1)
        if self.spec.diff is DiffMode.HASH:
            assert self._hashes is not None
            self._pending_hashes = self._page_hashes()
            return np.flatnonzero(self._pending_hashes != self._hashes).astype(np.int64)
        assert self._shadow is not None
        dirty = np.zeros(self.spec.n_pages, dtype=bool)
        if self._full_pages:
            cur = self._main()
            pb = self.spec.page_bytes
            shadow = self._shadow[: self._full_pages * pb].reshape(self._full_pages, pb)
            if pb % 8 == 0:
                cur, shadow = cur.view(np.uint64), shadow.view(np.uint64)
            dirty[: self._full_pages] = (cur != shadow).any(axis=1)
        if self._full_pages < self.spec.n_pages:
            dirty[-1] = not np.array_equal(self._tail(), self._shadow[self._full_pages * self.spec.page_bytes :])
        return np.flatnonzero(dirty).astype(np.int64)

    # ------------------------------------------------------------------------------------------ contract
    def collect(self, *, full: bool) -> RegionDelta:
        if full or not self._synced:
            pages = np.arange(self.spec.n_pages, dtype=np.int64)
            if self.spec.diff is DiffMode.HASH and self.spec.kind is RegionKind.OPAQUE:
                self._pending_hashes = self._page_hashes()
            scanned = 0
        else:
            pages = self._dirty_pages()
            scanned = self.spec.nbytes if self.spec.kind is RegionKind.OPAQUE else 0
        return RegionDelta(self.spec, pages, self.gather(pages), scanned_bytes=scanned)

    def stage(self, *, full: bool) -> CpuStaged:
        """An asynchronous epoch's snapshot: collect now, on the caller's thread, into memory the caller does
        not write (a whole-region payload, otherwise a view of the live buffer, is copied). A paged region's
        flags are taken now: the flagged blocks are cleared, and given back if the epoch fails."""
        delta = self.collect(full=full)
        if delta.n_pages and np.may_share_memory(np.frombuffer(delta.payload, dtype=np.uint8), self.buf):
            delta = RegionDelta(self.spec, delta.pages, memoryview(bytearray(delta.payload)),
                                scanned_bytes=delta.scanned_bytes)
        taken = None
        if self.spec.kind is RegionKind.PAGED and self.dirty_blocks is not None:
            taken = np.flatnonzero(self.dirty_blocks)
            self.dirty_blocks[taken] = 0
        return CpuStaged(self, delta, taken)

    @property
    def snapshot_device_bytes(self) -> int:
        return 0

    def advance(self, delta: RegionDelta) -> None:
        """The epoch holding ``delta`` committed: move the baseline to the committed bytes."""
        self._advance(delta, clear_flags=True)

    def _advance(self, delta: RegionDelta, *, clear_flags: bool) -> None:
        kind = self.spec.kind
        if kind is RegionKind.OPAQUE:
            if self.spec.diff is DiffMode.HASH:
                assert self._pending_hashes is not None
                if self._hashes is None or len(delta.pages) == self.spec.n_pages:
                    self._hashes = self._pending_hashes.copy()
                else:
                    self._hashes[delta.pages] = self._pending_hashes[delta.pages]
                self._pending_hashes = None
            else:
                self._write_pages(self._shadow_target(), delta.pages, delta.payload)
        elif kind is RegionKind.PAGED and clear_flags and self.dirty_blocks is not None and len(delta.pages):
            blocks = np.unique(delta.pages // self.spec.pages_per_block)
            self.dirty_blocks[blocks] = 0
        self._synced = True

    def _shadow_target(self) -> npt.NDArray[np.uint8]:
        if self._shadow is None:
            self._shadow = np.empty(self.spec.nbytes, dtype=np.uint8)
        return self._shadow

    def _write_pages(self, target: npt.NDArray[np.uint8], pages: npt.NDArray[np.int64], payload: memoryview) -> None:
        pb = self.spec.page_bytes
        n = len(pages)
        if n == 0:
            return
        src = np.frombuffer(payload, dtype=np.uint8).reshape(n, pb)
        full = self._full_pages
        has_tail = int(pages[-1]) == full and full < self.spec.n_pages
        body = pages[:-1] if has_tail else pages
        if len(body):
            main = target[: full * pb].reshape(full, pb)
            if int(body[-1]) - int(body[0]) + 1 == len(body):
                main[int(body[0]) : int(body[-1]) + 1] = src[: len(body)]
            else:
                main[body] = src[: len(body)]
        if has_tail:
            tail_len = self.spec.nbytes - full * pb
            target[full * pb :] = src[-1, :tail_len]

    def restore(self, pages: npt.NDArray[np.int64], payload: memoryview) -> None:
        """Write recovered pages into the region and make them the baseline (as if just committed). A payload
        that IS the region's memory (a replay that wrote the region in place) is not copied onto itself."""
        src = np.frombuffer(payload, dtype=np.uint8)
        in_place = (len(pages) == self.spec.n_pages and src.nbytes == self.buf.nbytes
                    and src.ctypes.data == self.buf.ctypes.data)
        if not in_place:
            self._write_pages(self.buf, pages, payload)
        delta = RegionDelta(self.spec, pages, payload)
        if self.spec.kind is RegionKind.OPAQUE and self.spec.diff is DiffMode.HASH:
            self._pending_hashes = self._page_hashes()
            if self._hashes is None:
                self._hashes = self._pending_hashes.copy()
        if self.spec.kind is RegionKind.OPAQUE and self.spec.diff is DiffMode.SHADOW and self._shadow is None:
            self._shadow = self.buf.copy()
        else:
            self.advance(delta)
        self._synced = len(pages) == self.spec.n_pages or self._synced

    def close(self) -> None:
        self._shadow = None
        self._hashes = None


class CpuStaged:
    """A host region's share of an asynchronous epoch: the snapshot is already a copy (``result`` is free)."""

    def __init__(self, tracker: CpuTracker, delta: RegionDelta, taken_blocks: npt.NDArray[np.intp] | None) -> None:
        self.spec = tracker.spec
        self._tracker = tracker
        self._delta = delta
        self._taken = taken_blocks

    def result(self) -> RegionDelta:
        return self._delta

    def commit(self, delta: RegionDelta) -> None:
        self._tracker._advance(delta, clear_flags=False)  # stage already cleared the flags it logged

    def abandon(self) -> None:
        t = self._tracker
        if self._taken is not None and len(self._taken) and t.dirty_blocks is not None:
            t.dirty_blocks[self._taken] = 1  # flagged again: the next epoch logs these blocks' current bytes
        t._pending_hashes = None


class CpuDenseBatch:
    """The dense host regions of a runtime, staged together by asynchronous epochs (core/tracking.py's
    DenseBatch). The first stage allocates ONE zeroed staging buffer holding every member at its padded offset
    and builds each member's delta (every page; the payload a view of its slice) once; each stage is then one
    copy per member and nothing else. The payload bytes are exactly ``CpuTracker.stage``'s: the region, then
    zeros to the end of its last page. The staging buffer is reused by the next stage (the runtime stages
    again only after the epoch in flight has finished), so it costs one padded copy of the dense host regions,
    held from the first asynchronous epoch on."""

    def __init__(self, trackers: list[CpuTracker]) -> None:
        for t in trackers:
            if t.spec.kind is not RegionKind.DENSE:
                raise AssertionError(f"region {t.spec.name!r} is {t.spec.kind.value}, not dense")
        self.trackers = trackers
        self.specs = [t.spec for t in trackers]
        self._copies: list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]] = []
        self._deltas: list[RegionDelta] = []

    def _allocate(self) -> None:
        sizes = [t.spec.n_pages * t.spec.page_bytes for t in self.trackers]
        staging = np.zeros(sum(sizes), dtype=np.uint8)
        off = 0
        for t, padded in zip(self.trackers, sizes, strict=True):
            pages = np.arange(t.spec.n_pages, dtype=np.int64)
            pages.flags.writeable = False
            self._copies.append((staging[off : off + t.spec.nbytes], t.buf))
            self._deltas.append(RegionDelta(t.spec, pages, memoryview(staging[off : off + padded])))
            off += padded

    def stage(self) -> CpuStagedBatch:
        if not self._deltas:
            self._allocate()
        for dst, src in self._copies:
            np.copyto(dst, src)
        return CpuStagedBatch(self)

    @property
    def snapshot_device_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self._copies, self._deltas = [], []


class CpuStagedBatch:
    """A CpuDenseBatch's share of an asynchronous epoch: the copies are made, ``results`` is free."""

    def __init__(self, batch: CpuDenseBatch) -> None:
        self._batch = batch

    def results(self) -> list[RegionDelta]:
        return self._batch._deltas

    def commit(self) -> None:
        for t in self._batch.trackers:
            t._synced = True

    def abandon(self) -> None:
        return None
