"""Replay: base + every committed epoch after it, verified, into host buffers. A reader never cuts anything.

``replay(log_dir)`` returns a ``ReplayResult`` with a named ``outcome``:

- ``ok``: every byte of the log belongs to a committed epoch (trailing zero bytes from preallocation aside);
- ``empty``: no log, or a log without a committed epoch;
- ``torn-tail``: the last epoch of the last segment was cut short (a write that never finished): it was never
  committed, it is not applied, and a writer reopening the log cuts it;
- ``damaged-tail``: the last epoch is whole in length but fails a checksum: it is not applied; a writer
  refuses to continue until `concordia log check DIR --fix` cuts it (that epoch is lost).

Damage anywhere before the tail raises ``LogCorruptError(path, offset, reason)``: the state after that point
cannot be trusted, and nothing is silently skipped.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LogCorruptError, LogError
from .epochs import DecodedEpoch, EpochTail, TailKind, decode_epoch, entry_meta, entry_pages, entry_spec
from .format import (
    EPOCH_HEADER_BYTES,
    EPOCH_MAGIC,
    REC_DROP,
    REC_META,
    REC_PAGES,
    REC_REGION,
    REC_RUNS,
    SEGMENT_BASE,
    SEGMENT_HEADER_BYTES,
    EpochHeader,
    FormatError,
    NewerFormatError,
    SegmentHeader,
)
from .manifest import Manifest, load_manifest
from .regions import RegionSpec
from .segment import map_segment


class Outcome(str, enum.Enum):
    OK = "ok"
    EMPTY = "empty"
    TORN_TAIL = "torn-tail"
    DAMAGED_TAIL = "damaged-tail"


@dataclass
class TailInfo:
    segment: str
    offset: int  # where the unusable bytes start (= end of the last good epoch)
    size_bytes: int  # bytes from offset to the end of the file
    kind: TailKind
    reason: str
    written_end: int = 0  # just past the tail's last nonzero byte (what a preallocated segment must clear)


@dataclass
class EpochSummary:
    epoch: int
    segment: str
    offset: int
    total_bytes: int
    payload_bytes: int
    full: bool
    pages: dict[str, int]
    region_bytes: int = 0  # bytes of all regions after this epoch: what a full copy would write


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


@dataclass
class ReplayResult:
    outcome: Outcome
    epoch: int | None
    regions: dict[str, RegionImage]
    meta: Any
    manifest: Manifest | None
    tail: TailInfo | None = None
    end_segment: str | None = None
    end_offset: int = 0
    trailing_zero_bytes: int = 0
    epochs: list[EpochSummary] = field(default_factory=list)
    bytes_read: int = 0

    @property
    def specs(self) -> dict[str, RegionSpec]:
        return {n: r.spec for n, r in self.regions.items()}


MAX_REGION_BYTES = 1 << 44  # 16 TiB: a format bound, checked before anything is allocated


def host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return MAX_REGION_BYTES


class _State:
    """Replay in two passes: every epoch is verified and its records checked as it is read (``add``), and
    only then are pages copied (``materialize``), newest first, so each page is copied once: its last
    committed version. Overwrite-heavy logs (dense adapters, optimizer state) replay at checksum speed."""

    def __init__(self) -> None:
        # recovered regions live in host memory: never allocate past it (a hostile or damaged size field)
        self.limit_bytes = min(MAX_REGION_BYTES, host_memory_bytes())
        self.specs: dict[str, RegionSpec] = {}
        self.born: dict[str, int] = {}  # name -> sequence number where the region's current contents began
        self.writes: list[tuple[int, str, npt.NDArray[np.int64], memoryview]] = []  # (seq, name, pages, payload)
        self.seq = 0
        self.meta: Any = None
        self.epoch: int | None = None
        self.regions: dict[str, RegionImage] = {}

    def add(self, ep: DecodedEpoch, path: str) -> dict[str, int]:
        """Check every record of a verified epoch against the region geometry; nothing is copied yet."""
        specs = {} if ep.full else dict(self.specs)
        born = {} if ep.full else dict(self.born)
        writes: list[tuple[int, str, npt.NDArray[np.int64], memoryview]] = []
        meta, has_meta = None, False
        pages_of: dict[str, int] = {}
        seq = self.seq
        try:
            for e in ep.entries:
                seq += 1
                if e.rtype == REC_REGION:
                    spec = entry_spec(e)
                    others = sum(sp.nbytes for n, sp in specs.items() if n != spec.name)
                    if spec.n_pages * spec.page_bytes + others > self.limit_bytes:
                        raise FormatError(f"region {spec.name!r} declares {spec.nbytes} bytes ({others} in other "
                                          f"regions): more than this machine's {self.limit_bytes} bytes of memory "
                                          "(a damaged size field, or a log from a machine with more memory)")
                    if specs.get(spec.name) != spec:  # new, or redefined: starts from zeros
                        born[spec.name] = seq
                    specs[spec.name] = spec
                elif e.rtype == REC_DROP:
                    specs.pop(e.name, None)
                    born.pop(e.name, None)
                elif e.rtype in (REC_PAGES, REC_RUNS):
                    if e.name not in specs:
                        raise FormatError(f"pages for region {e.name!r}, which no earlier record defines")
                    pages = entry_pages(e, specs[e.name])
                    pages_of[e.name] = len(pages)
                    if len(pages):
                        writes.append((seq, e.name, pages, ep.payload(e)))
                elif e.rtype == REC_META:
                    meta, has_meta = entry_meta(e), True
        except FormatError as err:
            raise LogCorruptError(path, ep.offset, f"epoch {ep.epoch}: {err}") from None
        self.specs, self.born, self.seq = specs, born, seq
        if ep.full:
            self.writes = []
        self.writes.extend(writes)
        if has_meta:
            self.meta = meta
        self.epoch = ep.epoch
        return pages_of

    def region_bytes(self) -> int:
        return sum(sp.nbytes for sp in self.specs.values())

    def materialize(self) -> None:
        """Copy each live page's newest committed version into a fresh image of its region.

        Deciding which write supplies each page is a cheap newest-first bitmap pass; the copies it leaves
        write disjoint pages, so large replays run them on several threads (numpy releases the GIL for them),
        which also spreads the first-touch cost of the fresh images."""
        images = {n: RegionImage(sp, np.zeros(sp.n_pages * sp.page_bytes, dtype=np.uint8))
                  for n, sp in self.specs.items()}
        filled = {n: np.zeros(sp.n_pages, dtype=bool) for n, sp in self.specs.items()}
        missing = {n: sp.n_pages for n, sp in self.specs.items()}
        jobs: list[tuple[RegionImage, npt.NDArray[np.int64], memoryview, npt.NDArray[np.bool_] | None]] = []
        copy_bytes = 0
        for seq, name, pages, payload in reversed(self.writes):
            if not missing.get(name) or seq < self.born[name]:
                continue
            done = filled[name]
            need = ~done[pages]
            n_need = int(np.count_nonzero(need))
            if n_need == 0:
                continue
            if n_need == len(pages):
                jobs.extend(_split(images[name], pages, payload))
            else:
                jobs.append((images[name], pages, payload, need))
            copy_bytes += n_need * images[name].spec.page_bytes
            done[pages] = True
            missing[name] -= n_need
        self.writes = []
        workers = min(8, os.cpu_count() or 1) if copy_bytes >= PARALLEL_COPY_BYTES else 1
        if workers <= 1:
            _run_copies(jobs)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="concordia-replay") as pool:
                list(pool.map(_run_copies, [jobs[i::workers] for i in range(workers)]))
        self.regions = images


PARALLEL_COPY_BYTES = 32 << 20
COPY_CHUNK_BYTES = 8 << 20  # one prefill epoch can hold a whole prompt's KV: split it so threads share it


def _split(img: RegionImage, pages: npt.NDArray[np.int64], payload: memoryview
           ) -> list[tuple[RegionImage, npt.NDArray[np.int64], memoryview, None]]:
    pb = img.spec.page_bytes
    step = max(1, COPY_CHUNK_BYTES // pb)
    if len(pages) <= step:
        return [(img, pages, payload, None)]
    return [(img, pages[i : i + step], payload[i * pb : (i + step) * pb], None) for i in range(0, len(pages), step)]


def _run_copies(jobs: list[tuple[RegionImage, npt.NDArray[np.int64], memoryview, npt.NDArray[np.bool_] | None]]
                ) -> None:
    for img, pages, payload, need in jobs:
        if need is None:
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


def _valid_epoch_header_after(buf: memoryview, start: int) -> int | None:
    """Offset of the next epoch header with a good checksum after ``start``, if any (damage vs tail)."""
    obj = buf.obj
    raw: Any = obj if hasattr(obj, "find") and len(obj) == len(buf) else bytes(buf)  # type: ignore[arg-type]
    pos = start
    while (idx := int(raw.find(EPOCH_MAGIC, pos))) >= 0:
        try:
            EpochHeader.decode(buf[idx : idx + EPOCH_HEADER_BYTES])
            return idx
        except FormatError:
            pos = idx + 1
    return None


def _open_segments(log_dir: Path, manifest: Manifest, names: list[str] | None
                   ) -> tuple[list[str], list[int], Manifest]:
    """Open every segment before replaying any: an open file survives a concurrent compaction's unlink.

    If a segment vanished between reading the manifest and opening it, a compaction swapped the manifest:
    read it again and retry (bounded). A segment missing from an unchanged manifest is real damage.
    """
    for _ in range(16):
        want = names if names is not None else manifest.segments()
        fds: list[int] = []
        try:
            for n in want:
                fds.append(os.open(log_dir / n, os.O_RDONLY))
            return want, fds, manifest
        except FileNotFoundError as e:
            for fd in fds:
                os.close(fd)
            newer = load_manifest(log_dir) if names is None else None
            if newer is None or newer.segments() == manifest.segments():
                raise LogCorruptError(str(e.filename), 0, "segment named in the manifest is missing",
                                      "restore it from a replica, or the log cannot be replayed past this point"
                                      ) from None
            manifest = newer
    raise LogError(f"{log_dir}: the manifest kept changing while it was being read (16 tries); is a compaction "
                   "looping? Try again once it is done")


def _all_zero(buf: memoryview, start: int) -> bool:
    rest = np.frombuffer(buf[start:], dtype=np.uint8)
    return not rest.any()


def replay(log_dir: str | Path, *, verify_payloads: bool = True, segments: Sequence[str] | None = None,
           collect_summaries: bool = False, manifest: Manifest | None = None,
           on_epoch: Callable[[EpochSummary], None] | None = None) -> ReplayResult:
    """Replay the log in ``log_dir`` (or only ``segments``, a prefix of the manifest's list)."""
    log_dir = Path(log_dir)
    if manifest is None:
        manifest = load_manifest(log_dir)
    if manifest is None:
        if log_dir.is_dir() and any(log_dir.glob("*.cft")):
            raise LogError(f"{log_dir} holds segment files but no MANIFEST; it was not written by a complete "
                           "`Runtime` start. Run `concordia log check DIR` to see what is there")
        return ReplayResult(Outcome.EMPTY, None, {}, None, None)
    names, fds, manifest = _open_segments(log_dir, manifest, list(segments) if segments is not None else None)
    st = _State()
    mappings = []
    try:
        result = ReplayResult(Outcome.OK, None, {}, None, manifest)
        for i, (name, fd) in enumerate(zip(names, fds, strict=True)):
            last = i == len(names) - 1
            mapping, buf = map_segment(fd)
            if mapping is not None:
                mappings.append(mapping)
            _replay_segment(st, result, name, str(log_dir / name), buf, last, manifest, verify_payloads,
                            collect_summaries, on_epoch, i == 0)
            del buf
            if result.tail is not None:
                break
        st.materialize()  # the payload views point into the mappings: copy before they close
    finally:
        st.writes = []
        for m in mappings:
            # an exception's traceback may still hold views of a mapping: then it is freed with them
            with contextlib.suppress(BufferError):
                m.close()
        for fd in fds:
            os.close(fd)
    result.epoch = st.epoch
    result.regions = st.regions
    result.meta = st.meta
    if st.epoch is None and result.outcome is Outcome.OK:
        result.outcome = Outcome.EMPTY
    return result


def _replay_segment(st: _State, result: ReplayResult, name: str, path: str, buf: memoryview, last: bool,
                    manifest: Manifest, verify: bool, summaries: bool,
                    on_epoch: Callable[[EpochSummary], None] | None, first: bool) -> None:
    size = len(buf)
    if size < SEGMENT_HEADER_BYTES:
        if last and _all_zero(buf, 0):
            result.tail = TailInfo(name, 0, size, TailKind.TORN, "segment header never finished")
            result.outcome = Outcome.TORN_TAIL
            return
        raise LogCorruptError(path, 0, f"segment is {size} bytes, shorter than its header")
    try:
        header = SegmentHeader.decode(buf[:SEGMENT_HEADER_BYTES])
    except FormatError as e:
        raise LogCorruptError(path, 0, str(e)) from None
    if header.log_id.hex() != manifest.log_id:
        raise LogCorruptError(path, 0, f"segment belongs to log {header.log_id.hex()}, not {manifest.log_id}",
                              "a segment from another log was copied in; remove it from this directory")
    if header.kind == SEGMENT_BASE and not first:
        raise LogCorruptError(path, 0, "a base segment appears after the first position in the manifest")
    pos = SEGMENT_HEADER_BYTES
    result.end_segment, result.end_offset = name, pos
    while pos < size:
        try:
            ep = decode_epoch(buf, pos, verify_payloads=verify)
        except NewerFormatError as e:
            raise LogError(f"{path} at offset {pos}: {e}") from None
        except EpochTail as t:
            if _all_zero(buf, pos):
                result.trailing_zero_bytes = size - pos
                return
            if not last:
                raise LogCorruptError(path, pos, t.reason,
                                      "this is not the last segment: later epochs depend on this one") from None
            later = _valid_epoch_header_after(buf, pos + 1)
            if later is not None:
                raise LogCorruptError(path, pos, f"{t.reason} (a valid epoch follows at offset {later})",
                                      "damage before the tail: the epochs before this offset are intact; "
                                      "run `concordia log check DIR` for a full report") from None
            nonzero = np.flatnonzero(np.frombuffer(buf[pos:], dtype=np.uint8))
            written_end = pos + int(nonzero[-1]) + 1 if len(nonzero) else pos
            result.tail = TailInfo(name, pos, size - pos, t.kind, t.reason, written_end)
            result.outcome = Outcome.TORN_TAIL if t.kind is TailKind.TORN else Outcome.DAMAGED_TAIL
            return
        if st.epoch is not None and not ep.full and ep.epoch != st.epoch + 1:
            raise LogCorruptError(path, pos, f"epoch {ep.epoch} follows epoch {st.epoch}: epochs are missing")
        if st.epoch is not None and ep.full and ep.epoch <= st.epoch:
            raise LogCorruptError(path, pos, f"base epoch {ep.epoch} does not advance past epoch {st.epoch}")
        pages = st.add(ep, path)
        result.bytes_read += ep.total_bytes
        pos += ep.total_bytes
        result.end_offset = pos
        if summaries or on_epoch is not None:
            s = EpochSummary(ep.epoch, name, ep.offset, ep.total_bytes, ep.payload_bytes, ep.full, pages,
                             st.region_bytes())
            if summaries:
                result.epochs.append(s)
            if on_epoch is not None:
                on_epoch(s)
