"""The handler contract every backend (CPU reference, CUDA) implements for one region.

One checkpoint epoch, per region:

1. ``delta = tracker.collect(full=...)`` finds the dirty pages and stages their bytes. ``full=True`` returns
   every page (first epoch of a region, base snapshots). Nothing about the tracker's own state changes here:
   if the epoch fails to commit, the same pages are found again next time.
2. The runtime appends every region's delta as ONE epoch and commits it.
3. ``tracker.advance(delta)`` runs only after the commit: shadows/hashes move forward, bitmaps are cleared.

Recovery calls ``tracker.restore(pages, payload)`` (or the backend's standalone restore) to scatter pages.

An asynchronous epoch (``Runtime.checkpoint_async``) splits step 1 in two, so the caller's thread only orders
the snapshot after its own work and never waits for the device:

1a. ``staged = tracker.stage(full=...)`` on the caller's thread takes a SNAPSHOT of the epoch's pages that later
    writes to the region cannot change (CUDA: detect + gather into a device buffer in stream order, then an
    event; host: a copy). A paged region's dirty flags are taken with it (read and cleared), so a block
    flagged again while the epoch is in flight is logged by the next epoch.
1b. ``delta = staged.result()`` on the background writer waits for the snapshot and stages it in host memory.
2.  The runtime appends and commits the epoch, as above.
3.  ``staged.commit(delta)`` advances the tracker (as ``advance``, minus clearing flags: stage took them), or,
    when anything before the commit failed, ``staged.abandon()`` gives the flags back so nothing is lost.

At most one staged epoch per tracker is outstanding: the runtime finishes (commits or abandons) the previous
one before it stages the next, so an opaque region's next scan compares against the in-flight epoch's bytes.

Dense regions have nothing to find and no baseline to advance, so an asynchronous epoch stages them together:
each backend groups its dense regions into a ``DenseBatch`` (CUDA: one per device), whose ``stage()`` snapshots
every member at once (CUDA: the copies of ``plan_dense_copies`` into one device buffer and ONE event; host: one
copy per member into one staging buffer) instead of a stage, an event and their bookkeeping per region. The
per-call cost is then that of the batch, not of the number of dense regions.

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


class StagedDelta(Protocol):
    """One region's share of an asynchronous epoch: a snapshot taken by ``Tracker.stage``."""

    spec: RegionSpec

    def result(self) -> RegionDelta:
        """Wait for the snapshot and return it staged in host memory (valid until the tracker's next stage or
        collect). Runs on the background writer."""
        ...

    def commit(self, delta: RegionDelta) -> None:
        """The epoch holding ``delta`` committed: advance the tracker's baseline to exactly these bytes."""
        ...

    def abandon(self) -> None:
        """The epoch did not commit: give back what ``stage`` took (a paged region's dirty flags)."""
        ...


class StagedBatch(Protocol):
    """A ``DenseBatch``'s share of an asynchronous epoch: every member's whole region, snapshotted together."""

    def results(self) -> list[RegionDelta]:
        """Wait for the snapshot; one delta per member (``DenseBatch.specs`` order), every page, staged in host
        memory that stays valid until the batch's next stage. Runs on the background writer."""
        ...

    def commit(self) -> None:
        """The epoch committed: the members hold a committed baseline (dense regions keep no other state)."""
        ...

    def abandon(self) -> None:
        """The epoch did not commit (nothing to give back: the next epoch logs every page again)."""
        ...


class DenseBatch(Protocol):
    """The dense regions of one backend (and device), staged together by asynchronous epochs."""

    specs: list[RegionSpec]  # the members, in the order ``results()`` returns their deltas

    def stage(self) -> StagedBatch: ...

    @property
    def snapshot_device_bytes(self) -> int: ...

    def close(self) -> None: ...


class Tracker(Protocol):
    """Finds, stages and restores the dirty pages of one registered region."""

    spec: RegionSpec

    def collect(self, *, full: bool) -> RegionDelta: ...

    def stage(self, *, full: bool) -> StagedDelta: ...

    @property
    def snapshot_device_bytes(self) -> int:
        """Device memory held for asynchronous snapshots (0 for host regions, or before the first stage)."""
        ...

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


def plan_dense_copies(regions: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The copies that snapshot dense regions into ONE buffer in which region ``i`` starts after the padded sizes
    of the regions before it. ``regions``: (address, nbytes, padded_bytes) in buffer order. Returns
    (buffer offset, source address, nbytes) per copy. A region that is a whole number of pages and ends where the
    next one starts shares its copy with it (LoRA's adapter and moments in one arena: one copy for both); any
    other region gets its own copy, so a padded tail's bytes in the buffer are never written (zero)."""
    copies: list[tuple[int, int, int]] = []
    dst = 0
    extends = False  # the previous region was whole pages: its copy ends exactly where this one's bytes go
    for addr, nbytes, padded in regions:
        if not 0 < nbytes <= padded:
            raise AssertionError(f"a region of {nbytes} bytes padded to {padded}")
        if extends and copies[-1][1] + copies[-1][2] == addr:
            off, src, n = copies[-1]
            copies[-1] = (off, src, n + nbytes)
        else:
            copies.append((dst, addr, nbytes))
        extends = nbytes == padded
        dst += padded
    return copies
