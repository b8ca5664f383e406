"""Region images: replay's second pass copies each live page's newest committed version, once, into them.

Replay's first pass (replay.py) verifies every epoch and records, per region, which pages each epoch wrote
(``PageWrite``: the pages and a view of their payload in the mapped segment). ``materialize_images`` then walks
the writes newest first with a bitmap of the pages already supplied, so every page is copied exactly once and
a log of overwrites costs one copy of the live state. The copies write disjoint pages, so large ones run on a
thread pool (numpy releases the GIL for them), in chunks, so one huge prefill epoch keeps every thread busy.

Images come from an allocator (``ImageAlloc``: nbytes -> writable buffer). The default is ``np.zeros``
(calloc: the zero pages cost nothing until written); a caller that restores to a GPU passes page-locked host
memory, so the copy to the device is one DMA at full PCIe speed. Memory from a caller's allocator is not
assumed to be zero: the pages no write supplies are zeroed here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from .regions import RegionSpec
from .tracking import pages_to_runs

ImageAlloc = Callable[[int], Any]  # nbytes -> a writable buffer of at least nbytes (contents undefined)

PARALLEL_COPY_BYTES = 16 << 20  # below this a replay copies on the calling thread
COPY_CHUNK_BYTES = 8 << 20  # one prefill epoch can hold a whole prompt's KV: split it so threads share it


def default_threads() -> int:
    """Threads for replay's checksums and copies: both are memory-bandwidth bound, 8 saturate a socket."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class RegionImage:
    """A region's recovered bytes: ``data`` is exactly ``spec.nbytes`` long."""

    spec: RegionSpec
    padded: npt.NDArray[np.uint8]  # n_pages * page_bytes

    @property
    def data(self) -> npt.NDArray[np.uint8]:
        return self.padded[: self.spec.nbytes]

    def pages_view(self) -> npt.NDArray[np.uint8]:
        return self.padded.reshape(self.spec.n_pages, self.spec.page_bytes)


@dataclass(frozen=True)
class PageWrite:
    """Pages of one region written by one committed record (``seq`` orders records across the log)."""

    seq: int
    name: str
    pages: npt.NDArray[np.int64]  # ascending, inside the region
    payload: memoryview  # len(pages) * page_bytes bytes


# A copy job writes ``pages`` of an image from ``payload`` (the rows selected by ``need``, or all of them),
# or zeroes them when ``payload`` is None.
_Job = tuple[RegionImage, npt.NDArray[np.int64], memoryview | None, npt.NDArray[np.bool_] | None]


def new_image(spec: RegionSpec, alloc: ImageAlloc | None) -> RegionImage:
    """An image for ``spec`` from ``alloc`` (None: zeroed numpy memory)."""
    nbytes = spec.n_pages * spec.page_bytes
    if alloc is None:
        return RegionImage(spec, np.zeros(nbytes, dtype=np.uint8))
    buf = alloc(nbytes)
    try:
        arr = np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the image allocator for region {spec.name!r} returned {type(buf).__name__}, not a "
                          f"buffer ({e})") from None
    if arr.nbytes < nbytes or not arr.flags.writeable:
        raise ConfigError(f"the image allocator for region {spec.name!r} returned {arr.nbytes} "
                          f"{'writable' if arr.flags.writeable else 'read-only'} bytes; it needs {nbytes} writable")
    return RegionImage(spec, arr[:nbytes])


def materialize_images(specs: Mapping[str, RegionSpec], born: Mapping[str, int], writes: Sequence[PageWrite], *,
                       allocs: Mapping[str, ImageAlloc] | None = None, threads: int | None = None,
                       pool: Executor | None = None, parallel_min_bytes: int = PARALLEL_COPY_BYTES
                       ) -> tuple[dict[str, RegionImage], int]:
    """Images of every region in ``specs`` from ``writes`` (oldest first); returns them and the bytes written.

    ``born[name]`` is the ``seq`` where the region's current contents began (a redefinition starts from
    zeros): older writes to it are ignored. ``allocs`` maps region names to allocators (default: zeroed
    numpy memory)."""
    allocs = allocs or {}
    images = {n: new_image(sp, allocs.get(n)) for n, sp in specs.items()}
    filled = {n: np.zeros(sp.n_pages, dtype=bool) for n, sp in specs.items()}
    missing = {n: sp.n_pages for n, sp in specs.items()}
    jobs: list[_Job] = []
    copy_bytes = 0
    for w in reversed(writes):
        if not missing.get(w.name) or w.seq < born[w.name]:
            continue
        done = filled[w.name]
        need = ~done[w.pages]
        n_need = int(np.count_nonzero(need))
        if n_need == 0:
            continue
        img = images[w.name]
        if n_need == len(w.pages):
            jobs.extend(_split(img, w.pages, w.payload))
        else:
            jobs.append((img, w.pages, w.payload, need))
        copy_bytes += n_need * img.spec.page_bytes
        done[w.pages] = True
        missing[w.name] -= n_need
    for name, img in images.items():
        if missing[name] and allocs.get(name) is not None:  # not zeroed by its allocator
            unfilled = np.flatnonzero(~filled[name]).astype(np.int64)
            jobs.extend(_split(img, unfilled, None))
            copy_bytes += len(unfilled) * img.spec.page_bytes
    workers = (threads or default_threads()) if copy_bytes >= parallel_min_bytes else 1
    if workers <= 1 or len(jobs) <= 1:
        _run_jobs(jobs)
    elif pool is not None:
        list(pool.map(_run_jobs, [jobs[i::workers] for i in range(workers)]))
    else:
        own = ThreadPoolExecutor(workers, thread_name_prefix="concordia-replay")
        try:
            list(own.map(_run_jobs, [jobs[i::workers] for i in range(workers)]))
        finally:
            own.shutdown(wait=False)  # idle once the copies are back: nothing needs to wait for them to exit
    return images, copy_bytes


def _split(img: RegionImage, pages: npt.NDArray[np.int64], payload: memoryview | None) -> list[_Job]:
    """Jobs of at most COPY_CHUNK_BYTES each."""
    pb = img.spec.page_bytes
    step = max(1, COPY_CHUNK_BYTES // pb)
    if len(pages) <= step:
        return [(img, pages, payload, None)]
    return [(img, pages[i : i + step], None if payload is None else payload[i * pb : (i + step) * pb], None)
            for i in range(0, len(pages), step)]


def _run_jobs(jobs: list[_Job]) -> None:
    for img, pages, payload, need in jobs:
        if payload is None:
            _zero(img, pages)
        elif need is None:
            _scatter(img, pages, payload)
        else:
            src = np.frombuffer(payload, dtype=np.uint8).reshape(len(pages), img.spec.page_bytes)
            img.pages_view()[pages[need]] = src[need]


def _scatter(img: RegionImage, pages: npt.NDArray[np.int64], payload: memoryview) -> None:
    pb = img.spec.page_bytes
    src = np.frombuffer(payload, dtype=np.uint8)
    n = len(pages)
    if int(pages[-1]) - int(pages[0]) + 1 == n:  # one run: a straight copy
        start = int(pages[0]) * pb
        img.padded[start : start + n * pb] = src
    else:
        img.pages_view()[pages] = src.reshape(n, pb)


def _zero(img: RegionImage, pages: npt.NDArray[np.int64]) -> None:
    pb = img.spec.page_bytes
    runs = pages_to_runs(pages)
    if len(runs) <= 64:
        for start, length in runs.tolist():
            img.padded[start * pb : (start + length) * pb] = 0
    else:
        img.pages_view()[pages] = 0
