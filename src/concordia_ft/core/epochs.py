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
    crc32c,
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


def plan_epoch(epoch: int, start_offset: int, *, defs: list[RegionSpec], drops: list[str],
               deltas: list[RegionDelta], meta: Any = None, full: bool = False,
               payload_crcs: list[int] | None = None) -> EpochPlan:
    """Lay out one epoch that will start at file offset ``start_offset``.

    ``payload_crcs`` (one per delta with pages, in order) are the payloads' CRC32C computed by the caller (e.g.
    on several threads, over bytes already placed in a mapped segment); without them they are computed here.
    The layout depends only on the payloads' sizes, so a caller may plan once to learn ``payload_offsets``,
    place the bytes there, and plan again with the placed views and their CRCs."""
    records: list[tuple[int, bytes, bytes, int, memoryview | None, int]] = []
    for spec in defs:
        records.append((REC_REGION, spec.name.encode(), encode_json(spec.describe()), 0, None, 0))
    for dropped in drops:
        records.append((REC_DROP, dropped.encode(), b"", 0, None, 0))
    for d in deltas:
        if not len(d.pages):
            continue
        n = len(d.pages)
        n_runs = 1 if n == 1 else 1 + int(np.count_nonzero(np.diff(d.pages) != 1))
        if n > 1 and n_runs * 2 <= n:
            var = pages_to_runs(d.pages).astype("<i8").tobytes()
            records.append((REC_RUNS, d.spec.name.encode(), var, n_runs, d.payload, n))
        else:
            var = d.pages.astype("<i8").tobytes()
            records.append((REC_PAGES, d.spec.name.encode(), var, len(d.pages), d.payload, len(d.pages)))
    if meta is not None:
        try:
            meta_json = encode_json(meta)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"epoch {epoch} not written: its metadata must be JSON-able (dicts with string keys, "
                              f"lists, strings, numbers, booleans, None): {e}; convert it (e.g. sets to lists, "
                              "arrays with .tolist()) and checkpoint again") from None
        records.append((REC_META, b"", meta_json, 0, None, 0))

    desc_bytes = sum(entry_size(len(r[1]), len(r[2])) for r in records)
    cursor = align_up(start_offset + EPOCH_HEADER_BYTES + desc_bytes) - start_offset
    payload_area = cursor
    offsets: list[int] = []
    for *_, payload, _ in records:
        if payload is not None:
            cursor = align_up(start_offset + cursor) - start_offset
            offsets.append(cursor)
            cursor += payload.nbytes
        else:
            offsets.append(0)
    total = cursor + COMMIT_BYTES

    desc = bytearray()
    parts_after: list[memoryview | bytes] = []
    pos = payload_area
    n_pages = 0
    region_pages: dict[str, int] = {}
    payload_offsets: list[int] = []
    payload_parts: list[int] = []
    for (rtype, name, var, count, payload, pages), off in zip(records, offsets, strict=True):
        if payload is not None:
            k = len(payload_offsets)
            if payload_crcs is not None and k >= len(payload_crcs):
                raise ValueError(f"{len(payload_crcs)} payload CRCs for more payloads than that")
            pcrc = crc32c(payload) if payload_crcs is None else int(payload_crcs[k])
            plen = payload.nbytes
            if off > pos:
                parts_after.append(_ZEROS[: off - pos])
            payload_offsets.append(off)
            payload_parts.append(1 + len(parts_after))
            parts_after.append(payload)
            pos = off + plen
            n_pages += pages
            region_pages[name.decode()] = pages
        else:
            pcrc, plen = 0, 0
        if rtype in (REC_REGION, REC_META):
            count = len(var)
        desc += encode_entry(rtype, name, var, count, off, plen, pcrc)
    desc_crc = crc32c(desc)
    payload_bytes = pos - payload_area
    header = EpochHeader(epoch, len(records), len(desc), total, payload_bytes,
                         EPOCH_FLAG_FULL if full else 0, desc_crc).encode()
    head = header + bytes(desc) + _ZEROS[: payload_area - EPOCH_HEADER_BYTES - len(desc)]
    parts: list[memoryview | bytes] = [head, *parts_after, encode_commit(epoch, total, desc_crc)]
    return EpochPlan(epoch, parts, total, payload_bytes, n_pages, region_pages, payload_offsets, payload_parts)


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

