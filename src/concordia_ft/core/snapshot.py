"""Writing a base segment (one FULL epoch) from a verified replay, streamed, in bounded memory, and sparse.

Compaction used to copy every region into an image in RAM (the whole state, in the serving process) and then
write the images whole, zero pages included. Here the base is written straight from the replay's verified
page writes, whose payloads are still in the mapped segments (``replay(..., materialize=False)``):

1. per region, a window of at most ``WINDOW_PAGES`` pages at a time: which committed write supplies each
   page's newest version (the writes overlapping the window, oldest first, later ones winning);
2. scan: the live pages are gathered in chunks of at most ``CHUNK_BYTES`` and the all-zero ones dropped. A
   page that no write supplies, or whose newest version is all zeros, replays as zeros from a FULL epoch
   (replay starts every region it defines from zeros), so it stays out of the base: the base is as sparse
   as the state, and replay gives identical bytes;
3. the epoch is laid out from the kept pages (``layout_epoch``), the payloads are gathered again chunk by
   chunk and written at their offsets while their CRCs are computed, then the header and descriptors (which
   hold those CRCs) and last the commit marker.

Memory: two index arrays of a window (12 bytes a page, 12 MiB), one chunk (8 MiB) and the kept page
numbers (8 bytes a kept page), never an image. The file is a ``.tmp`` until it is synced and renamed, so
the order in which its bytes are written does not matter for crash safety.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LogError
from .checksums import crc32c
from .epochs import layout_epoch
from .images import PageWrite
from .oscalls import REAL_OS, OsCalls
from .regions import RegionSpec

WINDOW_PAGES = 1 << 20
CHUNK_BYTES = 8 << 20


class RegionPages:
    """One region's newest committed page versions, read from the writes that supplied them."""

    def __init__(self, spec: RegionSpec, writes: Sequence[PageWrite]) -> None:
        self.spec = spec
        self.writes = list(writes)  # oldest first, all after the region's current contents began
        self._first = np.array([int(w.pages[0]) for w in self.writes], dtype=np.int64)
        self._last = np.array([int(w.pages[-1]) for w in self.writes], dtype=np.int64)

    def _newest(self, a: int, b: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
        """For pages [a, b): the index of the write holding each page's newest version (-1: none) and the
        page's row in that write's payload."""
        src = np.full(b - a, -1, dtype=np.int32)
        row = np.zeros(b - a, dtype=np.int64)
        for k in np.flatnonzero((self._first < b) & (self._last >= a)).tolist():
            pages = self.writes[k].pages
            lo, hi = np.searchsorted(pages, [a, b])
            src[pages[lo:hi] - a] = k
            row[pages[lo:hi] - a] = np.arange(lo, hi)
        return src, row

    def chunks(self, only: npt.NDArray[np.int64] | None = None, *, keep: npt.NDArray[np.int64] | None = None
               ) -> Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]]:
        """(pages, their bytes as a (k, page_bytes) array) for every live page (or only the pages in ``only``,
        ascending, all live; or the live ones of ``keep``, ascending), ascending, at most CHUNK_BYTES at a
        time."""
        pb = self.spec.page_bytes
        step = max(1, CHUNK_BYTES // pb)
        n = self.spec.n_pages
        for a in range(0, n, WINDOW_PAGES):
            b = min(n, a + WINDOW_PAGES)
            src, row = self._newest(a, b)
            if only is None and keep is None:
                idx = np.flatnonzero(src >= 0)
            elif only is None:
                assert keep is not None
                lo, hi = np.searchsorted(keep, [a, b])
                cand = keep[lo:hi] - a
                idx = cand[src[cand] >= 0]
            else:
                lo, hi = np.searchsorted(only, [a, b])
                idx = only[lo:hi] - a
            for i in range(0, len(idx), step):
                part = idx[i : i + step]
                yield part.astype(np.int64) + a, self._gather(src[part], row[part])

    def _gather(self, s: npt.NDArray[np.int32], r: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """The rows ``r`` of writes ``s``: a view when they are consecutive rows of one write (a dense or
        contiguous delta: no copy), else gathered into a new array."""
        pb = self.spec.page_bytes
        ks = np.unique(s).tolist()
        if ks and ks[0] < 0:
            raise AssertionError(f"region {self.spec.name!r}: a page asked for was never written")
        payloads = {k: np.frombuffer(self.writes[k].payload, dtype=np.uint8).reshape(-1, pb) for k in ks}
        if len(ks) == 1 and int(r[-1]) - int(r[0]) + 1 == len(r):
            return payloads[ks[0]][int(r[0]) : int(r[-1]) + 1]
        out = np.empty((len(r), pb), dtype=np.uint8)
        if len(ks) == 1:
            np.take(payloads[ks[0]], r, axis=0, out=out)
            return out
        order = np.argsort(s, kind="stable")  # group the rows by write: one gather per write, not a mask each
        bounds = np.searchsorted(s[order], ks + [ks[-1] + 1])
        for k, lo, hi in zip(ks, bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            sel = order[lo:hi]
            out[sel] = payloads[k][r[sel]]
        return out

    def nonzero_pages(self, keep: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.int64]:
        """The live pages whose newest version is not all zeros (what the base must hold); with ``keep`` (pages,
        ascending), only those of them: the others are not read."""
        kept: list[npt.NDArray[np.int64]] = []
        wide = self.spec.page_bytes % 8 == 0
        for pages, data in self.chunks(keep=keep):
            rows = data.view(np.uint64) if wide else data
            kept.append(pages[rows.any(axis=1)])
        return np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)


def region_pages(specs: Mapping[str, RegionSpec], born: Mapping[str, int], writes: Sequence[PageWrite]
                 ) -> list[RegionPages]:
    """Every region of a verified replay state, with the writes that count for it (oldest first)."""
    by_name: dict[str, list[PageWrite]] = {n: [] for n in specs}
    for w in writes:
        if w.name in by_name and w.seq >= born[w.name]:
            by_name[w.name].append(w)
    return [RegionPages(specs[n], by_name[n]) for n in specs]


def write_base(log_dir: Path, name: str, header: bytes, epoch: int, regions: Sequence[RegionPages], meta: Any, *,
               kill_hook: Callable[[str], None] | None = None, io: OsCalls = REAL_OS,
               keep: Mapping[str, npt.NDArray[np.int64]] | None = None) -> int:
    """Write segment ``name`` (via ``name.tmp``, synced, renamed, directory synced) holding one FULL epoch of
    ``regions``' nonzero pages and ``meta``. Returns the file's size. Every call that changes the directory
    goes through ``io`` (the log's OS boundary); a failure leaves at most a ``.tmp`` (deleted here, or as
    crash debris at the next open): the log itself is untouched until the manifest names the base.

    ``keep``: for the regions it names, the pages (ascending) the state still needs; the others are dead (the
    KV rows of a serving engine's freed blocks) and replay as zeros from the base."""
    tmp = log_dir / (name + ".tmp")
    io.unlink_quietly(tmp)
    kept = [(r, r.nonzero_pages(None if keep is None else keep.get(r.spec.name))) for r in regions]
    start = len(header)
    lay = layout_epoch(epoch, start, defs=[r.spec for r in regions], drops=[],
                       pages_of=[(r.spec, pages) for r, pages in kept], meta=meta, full=True)
    fd = io.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite_all(io, fd, header, 0)
        if kill_hook:
            kill_hook("base-writing")
        crcs: list[int] = []
        offsets = iter(lay.payload_offsets)
        for r, pages in kept:
            if not len(pages):
                continue
            pos = start + next(offsets)
            crc = 0
            for _, data in r.chunks(pages):
                crc = crc32c(data.data.cast("B"), crc)
                _pwrite_all(io, fd, data, pos)
                pos += data.nbytes
            crcs.append(crc)
        head, desc_crc = lay.head(crcs)
        commit = lay.commit(desc_crc)
        _pwrite_all(io, fd, head, start)
        _pwrite_all(io, fd, commit, start + lay.total_bytes - len(commit))
        io.fsync(fd)
        size = os.fstat(fd).st_size
    except BaseException:
        io.close_quietly(fd)
        io.unlink_quietly(tmp)
        raise
    io.close(fd)
    if size != start + lay.total_bytes:
        raise LogError(f"base {tmp} is {size} bytes after writing, expected {start + lay.total_bytes}")
    if kill_hook:
        kill_hook("base-written")
    io.replace(tmp, log_dir / name)
    io.fsync_dir(log_dir)
    return size


def _pwrite_all(io: OsCalls, fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = io.pwritev(fd, [view], offset)
        view = view[n:]
        offset += n
