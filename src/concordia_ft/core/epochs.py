"""Encoding one epoch into the buffers a single vectored write sends, and decoding one back.

``plan_epoch`` lays out header, descriptor area, 4 KiB-aligned payloads (referenced, never copied) and the
commit marker. ``decode_epoch`` validates an epoch completely (header CRC, descriptor CRC, every payload CRC,
commit marker) before the caller applies any of it, so an epoch is applied whole or not at all.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError
from .checksums import crc32c
from .format import (
    ALIGN,
    COMMIT_BYTES,
    EPOCH_FLAG_FULL,
    EPOCH_HEADER_BYTES,
    REC_DROP,
    REC_META,
    REC_PAGES,
    REC_REGION,
    REC_RUNS,
    Entry,
    EpochHeader,
    FormatError,
    NewerFormatError,
    align_up,
    check_commit,
    decode_entries,
    decode_json,
    encode_commit,
    encode_entry,
    encode_json,
    entry_size,
)
from .regions import RegionSpec
from .tracking import RegionDelta, pages_to_runs, runs_to_pages

_ZEROS = bytes(ALIGN)


@dataclass
class EpochPlan:
    """The buffers of one epoch, in file order, and what they hold."""

    epoch: int
    parts: list[memoryview | bytes]
    total_bytes: int
    payload_bytes: int
    n_pages: int
    region_pages: dict[str, int] = field(default_factory=dict)
    # per delta with pages (in ``deltas`` order): where its payload starts, relative to the epoch's start, and
    # the index of its buffer in ``parts`` (a payload placed in the segment beforehand is not copied again)
    payload_offsets: list[int] = field(default_factory=list)
    payload_parts: list[int] = field(default_factory=list)


# one record before its payload is known: (type, name, body, count, payload bytes or -1 for none, pages)
_Record = tuple[int, bytes, bytes, int, int, int]


# a region's page record kept for the next epoch that hands the SAME read-only pages array (a dense region's
# pages are one fixed array: core/mapped.py's placed epochs then skip re-encoding thousands of page numbers)
RecordCache = dict[tuple[str, int], tuple[Any, int, int, int, _Record]]


def _cached_record(cache: RecordCache | None, spec: RegionSpec, pages: npt.NDArray[np.int64]) -> _Record | None:
    if cache is None:
        return None
    hit = cache.get((spec.name, spec.page_bytes))
    if hit is None or hit[0] is not pages:
        return None
    _, n, first, last, rec = hit
    # the array is the same object and read-only (checked when it was cached); its ends are checked again
    return rec if n == len(pages) and first == int(pages[0]) and last == int(pages[-1]) else None


def _records(epoch: int, defs: list[RegionSpec], drops: list[str],
             pages_of: list[tuple[RegionSpec, npt.NDArray[np.int64]]], meta: Any,
             cache: RecordCache | None = None) -> list[_Record]:
    """The epoch's records in file order; a region's pages go in a RUNS record when they form at most half
    as many runs as pages, a PAGES record otherwise. ``cache``: page records of read-only pages arrays, reused
    while the same array object comes again."""
    records: list[_Record] = []
    for spec in defs:
        records.append((REC_REGION, spec.name.encode(), encode_json(spec.describe()), 0, -1, 0))
    for dropped in drops:
        records.append((REC_DROP, dropped.encode(), b"", 0, -1, 0))
    for spec, pages in pages_of:
        n = len(pages)
        if not n:
            continue
        hit = _cached_record(cache, spec, pages)
        if hit is not None:
            records.append(hit)
            continue
        if cache is not None and not pages.flags.writeable and pages.base is None:
            count = len(records)
            _page_record(records, spec, pages)
            cache[(spec.name, spec.page_bytes)] = (pages, n, int(pages[0]), int(pages[-1]), records[count])
            continue
        _page_record(records, spec, pages)
    if meta is not None:
        try:
            meta_json = encode_json(meta)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"epoch {epoch} not written: its metadata must be JSON-able (dicts with string keys, "
                              f"lists, strings, numbers, booleans, None): {e}; convert it (e.g. sets to lists, "
                              "arrays with .tolist()) and checkpoint again") from None
        records.append((REC_META, b"", meta_json, 0, -1, 0))
    return records


def _page_record(records: list[_Record], spec: RegionSpec, pages: npt.NDArray[np.int64]) -> None:
    n = len(pages)
    nbytes = n * spec.page_bytes
    n_runs = 1 if n == 1 else 1 + int(np.count_nonzero(np.diff(pages) != 1))
    if n > 1 and n_runs * 2 <= n:
        records.append((REC_RUNS, spec.name.encode(), pages_to_runs(pages).astype("<i8").tobytes(), n_runs,
                        nbytes, n))
    else:
        records.append((REC_PAGES, spec.name.encode(), pages.astype("<i8").tobytes(), n, nbytes, n))


@dataclass
class EpochLayout:
    """Where everything of one epoch goes, before any payload byte is read: ``payload_offsets[i]`` is the
    offset (relative to the epoch start) of the i-th payload-carrying record's payload."""

    epoch: int
    full: bool
    records: list[_Record]
    offsets: list[int]  # per record, 0 when it has no payload
    payload_area: int
    total_bytes: int

    @property
    def payload_offsets(self) -> list[int]:
        return [off for r, off in zip(self.records, self.offsets, strict=True) if r[4] >= 0]

    @property
    def payload_bytes(self) -> int:
        ends = [off + r[4] for r, off in zip(self.records, self.offsets, strict=True) if r[4] >= 0]
        return (ends[-1] - self.payload_area) if ends else 0

    def head(self, crcs: list[int]) -> tuple[bytes, int]:
        """Header + descriptor area + zero pad (the epoch's first ``payload_area`` bytes) and the descriptor
        CRC, given the payloads' CRCs in record order."""
        desc = bytearray()
        it = iter(crcs)
        for (rtype, name, var, count, nbytes, _), off in zip(self.records, self.offsets, strict=True):
            pcrc, plen = (next(it), nbytes) if nbytes >= 0 else (0, 0)
            if rtype in (REC_REGION, REC_META):
                count = len(var)
            desc += encode_entry(rtype, name, var, count, off, plen, pcrc)
        desc_crc = crc32c(desc)
        header = EpochHeader(self.epoch, len(self.records), len(desc), self.total_bytes, self.payload_bytes,
                             EPOCH_FLAG_FULL if self.full else 0, desc_crc).encode()
        return header + bytes(desc) + _ZEROS[: self.payload_area - EPOCH_HEADER_BYTES - len(desc)], desc_crc

    def commit(self, desc_crc: int) -> bytes:
        return encode_commit(self.epoch, self.total_bytes, desc_crc)


def layout_epoch(epoch: int, start_offset: int, *, defs: list[RegionSpec], drops: list[str],
                 pages_of: list[tuple[RegionSpec, npt.NDArray[np.int64]]], meta: Any = None,
                 full: bool = False, record_cache: RecordCache | None = None) -> EpochLayout:
    """Lay out one epoch that will start at file offset ``start_offset`` from the pages each region writes
    (payloads 4 KiB-aligned in the file). A writer that streams its payloads (a compaction's base) fills them
    in later and asks for the head with their CRCs. ``record_cache``: see ``_records``."""
    records = _records(epoch, defs, drops, pages_of, meta, record_cache)
    desc_bytes = sum(entry_size(len(r[1]), len(r[2])) for r in records)
    cursor = align_up(start_offset + EPOCH_HEADER_BYTES + desc_bytes) - start_offset
    payload_area = cursor
    offsets: list[int] = []
    for r in records:
        if r[4] >= 0:
            cursor = align_up(start_offset + cursor) - start_offset
            offsets.append(cursor)
            cursor += r[4]
        else:
            offsets.append(0)
    return EpochLayout(epoch, full, records, offsets, payload_area, cursor + COMMIT_BYTES)


def plan_epoch(epoch: int, start_offset: int, *, defs: list[RegionSpec], drops: list[str],
               deltas: list[RegionDelta], meta: Any = None, full: bool = False,
               payload_crcs: list[int] | None = None) -> EpochPlan:
    """Lay out one epoch that will start at file offset ``start_offset``: the buffers of one vectored write.

    ``payload_crcs`` (one per delta with pages, in order) are the payloads' CRC32C computed by the caller (e.g.
    on several threads, over bytes already placed in a mapped segment); without them they are computed here.
    The layout depends only on the payloads' sizes, so a caller may plan once to learn ``payload_offsets``,
    place the bytes there, and plan again with the placed views and their CRCs (core/mapped.py)."""
    deltas = [d for d in deltas if len(d.pages)]
    lay = layout_epoch(epoch, start_offset, defs=defs, drops=drops, pages_of=[(d.spec, d.pages) for d in deltas],
                       meta=meta, full=full)
    payloads = [d.payload for d in deltas]
    if payload_crcs is not None and len(payload_crcs) < len(payloads):
        raise ValueError(f"{len(payload_crcs)} payload CRCs for {len(payloads)} payloads")
    crcs = [crc32c(p) for p in payloads] if payload_crcs is None else [int(c) for c in payload_crcs[:len(payloads)]]
    return assemble_epoch(lay, deltas, crcs)


def assemble_epoch(lay: EpochLayout, deltas: list[RegionDelta], crcs: list[int]) -> EpochPlan:
    """The buffers of an epoch laid out as ``lay`` (``layout_epoch``, from the same deltas' pages), given its
    payloads (``deltas`` with pages, in order) and their CRC32Cs: a caller that placed the payloads at
    ``lay.payload_offsets`` first lays the epoch out once, not twice (core/log.py)."""
    payloads = [d.payload for d in deltas]
    head, desc_crc = lay.head(crcs)
    parts: list[memoryview | bytes] = [head]
    pos = lay.payload_area
    payload_parts: list[int] = []
    for p, off in zip(payloads, lay.payload_offsets, strict=True):
        if off > pos:
            parts.append(_ZEROS[: off - pos])
        payload_parts.append(len(parts))
        parts.append(p)
        pos = off + p.nbytes
    parts.append(lay.commit(desc_crc))
    region_pages = {d.spec.name: len(d.pages) for d in deltas}
    return EpochPlan(lay.epoch, parts, lay.total_bytes, lay.payload_bytes, sum(region_pages.values()),
                     region_pages, list(lay.payload_offsets), payload_parts)


class TailKind(str, enum.Enum):
    TORN = "torn"  # the epoch's bytes end before its declared end: a write that never finished
    DAMAGED = "damaged"  # the epoch is whole in length but fails a check (media damage or a lost write)


class EpochTail(Exception):
    """Raised by decode_epoch when the epoch at ``offset`` cannot be used; ``kind`` says why."""

    def __init__(self, kind: TailKind, reason: str) -> None:
        super().__init__(kind, reason)
        self.kind = kind
        self.reason = reason


@dataclass
class DecodedEpoch:
    epoch: int
    flags: int
    offset: int
    total_bytes: int
    payload_bytes: int
    entries: list[Entry]
    view: memoryview  # the epoch's bytes

    @property
    def full(self) -> bool:
        return bool(self.flags & EPOCH_FLAG_FULL)

    def payload(self, e: Entry) -> memoryview:
        return self.view[e.payload_off : e.payload_off + e.payload_len]


def decode_epoch(buf: memoryview, offset: int, *, verify_payloads: bool = True) -> DecodedEpoch:
    """Validate and decode the epoch at ``offset`` of a segment mapped as ``buf``."""
    remaining = len(buf) - offset
    if remaining < EPOCH_HEADER_BYTES:
        raise EpochTail(TailKind.TORN, f"epoch header cut short ({remaining} of {EPOCH_HEADER_BYTES} bytes)")
    head = buf[offset : offset + EPOCH_HEADER_BYTES]
    if not any(bytes(head)):
        # the header is written after the payloads when they are placed in a mapped segment first (DMA): an
        # append that never got its header leaves payload bytes behind a zero header
        raise EpochTail(TailKind.TORN, "epoch header never written (an append that never finished)")
    try:
        h = EpochHeader.decode(head)
    except NewerFormatError:
        raise  # not damage: a checksummed header from a newer writer; never cut it as a tail
    except FormatError as e:
        raise EpochTail(TailKind.DAMAGED, str(e)) from None
    if h.total_bytes > remaining:
        raise EpochTail(TailKind.TORN, f"epoch {h.epoch} declares {h.total_bytes} bytes, only {remaining} present")
    view = buf[offset : offset + h.total_bytes]
    if not any(bytes(view[h.total_bytes - COMMIT_BYTES :])):
        # the marker is the last thing written: in a preallocated (DAX) segment an unfinished append is
        # whole in length but has no marker yet
        raise EpochTail(TailKind.TORN, f"epoch {h.epoch} has no commit marker (its write never finished)")
    desc = view[EPOCH_HEADER_BYTES : EPOCH_HEADER_BYTES + h.desc_bytes]
    try:
        if crc32c(desc) != h.desc_crc:
            raise FormatError(f"epoch {h.epoch} descriptor checksum mismatch")
        payload_start = EPOCH_HEADER_BYTES + h.desc_bytes
        entries = decode_entries(desc, h.n_records, payload_start, h.total_bytes)
        check_commit(view[h.total_bytes - COMMIT_BYTES :], h.epoch, h.total_bytes, h.desc_crc)
        if verify_payloads:
            for i, ent in enumerate(entries):
                if ent.payload_len and crc32c(view[ent.payload_off : ent.payload_off + ent.payload_len]) != ent.payload_crc:
                    raise FormatError(f"epoch {h.epoch} record {i} ({ent.name!r}) payload checksum mismatch")
    except FormatError as err:
        raise EpochTail(TailKind.DAMAGED, str(err)) from None
    return DecodedEpoch(h.epoch, h.flags, offset, h.total_bytes, h.payload_bytes, entries, view)


def entry_pages(e: Entry, spec: RegionSpec) -> npt.NDArray[np.int64]:
    """The page indices a PAGES/RUNS record covers, validated against the region's geometry."""
    arr = np.frombuffer(e.var, dtype="<i8")
    n_pages = spec.n_pages
    if e.rtype == REC_RUNS and len(arr) <= 32:  # few runs (a token's KV rows, a dense region): plain ints
        runs = arr.tolist()
        end = 0
        for start, length in zip(runs[0::2], runs[1::2], strict=True):
            if length <= 0 or start < end or start >= n_pages or length > n_pages - start:
                raise FormatError(f"record for {e.name!r} has runs that are empty, overlapping, out of order or "
                                  f"outside [0, {n_pages})")
            end = start + length
        pages = (np.arange(runs[0], runs[0] + runs[1], dtype=np.int64) if len(runs) == 2
                 else runs_to_pages(arr.reshape(-1, 2).astype(np.int64)))
    elif e.rtype == REC_RUNS:
        runs2 = arr.reshape(-1, 2)
        starts, lengths = runs2[:, 0], runs2[:, 1]
        # each bound alone first (no int64 overflow), then ascending and disjoint: together they cap the
        # total at n_pages before anything is expanded
        if (np.any(lengths <= 0) or np.any(starts < 0) or np.any(starts >= n_pages)
                or np.any(lengths > n_pages - starts) or np.any(starts[1:] < starts[:-1] + lengths[:-1])):
            raise FormatError(f"record for {e.name!r} has runs that are empty, overlapping, out of order or "
                              f"outside [0, {n_pages})")
        pages = runs_to_pages(runs2)
    else:
        pages = arr.astype(np.int64)
        if len(pages) and (pages[0] < 0 or pages[-1] >= n_pages
                           or (len(pages) > 1 and bool((np.diff(pages) <= 0).any()))):
            raise FormatError(f"record for {e.name!r} has page indices outside [0, {n_pages}) or out of order")
    if len(pages) * spec.page_bytes != e.payload_len:
        raise FormatError(f"record for {e.name!r}: {len(pages)} pages of {spec.page_bytes} bytes but "
                          f"{e.payload_len} payload bytes")
    return pages


def entry_spec(e: Entry) -> RegionSpec:
    doc = decode_json(e.var, f"region record {e.name!r}")
    if not isinstance(doc, dict):
        raise FormatError(f"region record {e.name!r} is not an object")
    try:
        spec = RegionSpec.from_description(doc)
    except ValueError as err:
        raise FormatError(str(err)) from None
    if spec.name != e.name:
        raise FormatError(f"region record named {e.name!r} describes {spec.name!r}")
    return spec


def entry_meta(e: Entry) -> Any:
    return decode_json(e.var, "session metadata")

