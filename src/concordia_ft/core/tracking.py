"""The handler contract every backend (CPU reference, CUDA) implements for one region.

One checkpoint epoch, per region:

1. ``delta = tracker.collect(full=...)`` finds the dirty pages and stages their bytes. ``full=True`` returns
   every page (first epoch of a region, base snapshots). Nothing about the tracker's own state changes here:
   if the epoch fails to commit, the same pages are found again next time.
2. The runtime appends every region's delta as ONE epoch and commits it.
3. ``tracker.advance(delta)`` runs only after the commit: shadows/hashes move forward, bitmaps are cleared.

Recovery calls ``tracker.restore(pages, payload)`` (or the backend's standalone restore) to scatter pages.

A ``RegionDelta``'s payload holds ``len(pages) * page_bytes`` bytes, pages in ascending order, each page's
bytes at ``i * page_bytes``. The last page of a region that is not a whole number of pages is zero-padded in
the payload; restore writes only the region's real bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .regions import RegionSpec


@dataclass
class RegionDelta:
    spec: RegionSpec
    pages: npt.NDArray[np.int64]  # ascending, unique page indices
    payload: memoryview  # len(pages) * spec.page_bytes bytes (C-contiguous, byte format)
    scanned_bytes: int = 0  # bytes the detector read (for reports)

    def __post_init__(self) -> None:
        want = len(self.pages) * self.spec.page_bytes
        if self.payload.nbytes != want:
            raise AssertionError(
                f"region {self.spec.name!r}: payload is {self.payload.nbytes} bytes for {len(self.pages)} pages "
                f"of {self.spec.page_bytes} (want {want})"
            )

    @property
    def n_pages(self) -> int:
        return len(self.pages)


class Tracker(Protocol):
    """Finds, stages and restores the dirty pages of one registered region."""

    spec: RegionSpec

    def collect(self, *, full: bool) -> RegionDelta: ...

    def advance(self, delta: RegionDelta) -> None: ...

    def restore(self, pages: npt.NDArray[np.int64], payload: memoryview) -> None: ...

    def close(self) -> None: ...


def pages_to_runs(pages: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Ascending page indices -> (start, length) pairs, shape (n_runs, 2). Vectorised."""
    if len(pages) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    return np.stack([pages[starts], ends - starts], axis=1).astype(np.int64)


def runs_to_pages(runs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """(start, length) pairs -> ascending page indices. Vectorised."""
    if len(runs) == 0:
        return np.zeros(0, dtype=np.int64)
    starts, lengths = runs[:, 0], runs[:, 1]
    total = int(lengths.sum())
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return (offsets + np.arange(total, dtype=np.int64)).astype(np.int64)
