"""Byte layout of the recovery log: segment headers, epoch headers, record entries, commit markers.

Pure encode/decode: no I/O. Every integer is little-endian. Every length read from disk is bounded before
anything is allocated from it. The layout is written up in DESIGN.md beside this file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from .checksums import crc32c
from .regions import KIND_BY_CODE, RegionKind

FORMAT_VERSION = 1
ALIGN = 4096  # payloads start at file offsets that are multiples of this

SEGMENT_MAGIC = b"CONCRDFT"
EPOCH_MAGIC = b"CFTEPOCH"
COMMIT_MAGIC = b"CFTCOMMT"

SEGMENT_BASE = 1
SEGMENT_INCR = 2

# Segment header: magic, version, kind, header_len, log_id(16), generation, created_ns, crc; padded to ALIGN.
_SEG = struct.Struct("<8sHHI16sQQ")
SEGMENT_HEADER_BYTES = ALIGN

# Epoch header: magic, version, flags, n_records, epoch, desc_bytes, total_bytes, payload_bytes, header_crc.
_EPOCH = struct.Struct("<8sHHIQQQQ")
EPOCH_HEADER_BYTES = _EPOCH.size + 4 + 4  # + crc + desc_crc
EPOCH_FLAG_FULL = 1  # every region's every page (a base snapshot)

# Record entry: rtype, flags, name_len, count, var_len, payload_off, payload_len, payload_crc, reserved.
_ENTRY = struct.Struct("<HHIQQQQII")
ENTRY_BYTES = _ENTRY.size

# Commit marker: magic, epoch, total_bytes, desc_crc, marker_crc.
_COMMIT = struct.Struct("<8sQQI")
COMMIT_BYTES = _COMMIT.size + 4

REC_REGION = 1  # var = JSON spec; no payload
REC_PAGES = 2  # var = name + int64 page indices; payload = pages
REC_RUNS = 3  # var = name + int64 (start, length) pairs; payload = pages of the runs, in order
REC_META = 4  # var = JSON session metadata; no payload
REC_DROP = 5  # var = name; the region is no longer registered
RECORD_TYPES = {REC_REGION, REC_PAGES, REC_RUNS, REC_META, REC_DROP}

# Bounds: anything larger is damage or hostility, never a reason to allocate.
MAX_RECORDS = 1 << 20
MAX_DESC_BYTES = 1 << 30
MAX_VAR_BYTES = 1 << 30
MAX_EPOCH_BYTES = 1 << 46  # 64 TiB
MAX_NAME_BYTES = 200


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class FormatError(ValueError):
    """Bytes that do not decode as the log format. ``reason`` is short and names the field."""


class NewerFormatError(FormatError):
    """A record with a valid checksum but a format version this build does not know: a newer writer's."""


# ----------------------------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class SegmentHeader:
    kind: int
    log_id: bytes
    generation: int
    created_ns: int
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        body = _SEG.pack(SEGMENT_MAGIC, self.version, self.kind, SEGMENT_HEADER_BYTES, self.log_id,
                         self.generation, self.created_ns)
        out = bytearray(SEGMENT_HEADER_BYTES)
        out[: len(body)] = body
        struct.pack_into("<I", out, len(body), crc32c(body))
        return bytes(out)

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> SegmentHeader:
        if len(buf) < _SEG.size + 4:
            raise FormatError(f"segment header is {len(buf)} bytes, shorter than {_SEG.size + 4}")
        magic, version, kind, header_len, log_id, generation, created_ns = _SEG.unpack_from(buf, 0)
        if magic != SEGMENT_MAGIC:
            raise FormatError(f"not a Concordia-FT segment (magic {bytes(magic)!r})")
        (crc,) = struct.unpack_from("<I", buf, _SEG.size)
        if crc != crc32c(bytes(buf[: _SEG.size])):
            raise FormatError("segment header checksum mismatch")
        if version != FORMAT_VERSION:
            raise FormatError(
                f"segment format version {version} is not supported (this build reads version {FORMAT_VERSION}); "
                "upgrade concordia-ft to read it"
            )
        if kind not in (SEGMENT_BASE, SEGMENT_INCR) or header_len != SEGMENT_HEADER_BYTES:
            raise FormatError(f"segment header has kind {kind} and length {header_len}: not a valid segment")
        return cls(kind=kind, log_id=bytes(log_id), generation=generation, created_ns=created_ns, version=version)


# ------------------------------------------------------------------------------------------------ records
@dataclass
class Entry:
    """One record of an epoch, decoded from its fixed entry plus variable part."""

    rtype: int
    name: str
    count: int  # pages (REC_PAGES), runs (REC_RUNS), bytes of JSON otherwise
    var: memoryview  # after the name
    payload_off: int  # relative to the epoch start
    payload_len: int
    payload_crc: int


def encode_entry(rtype: int, name: bytes, var: bytes, count: int, payload_off: int, payload_len: int,
                 payload_crc: int) -> bytes:
    vlen = len(name) + len(var)
    pad = align_up(vlen, 8) - vlen
    head = _ENTRY.pack(rtype, 0, len(name), count, vlen, payload_off, payload_len, payload_crc, 0)
    return head + name + var + b"\0" * pad


def entry_size(name_len: int, var_len: int) -> int:
    return ENTRY_BYTES + align_up(name_len + var_len, 8)


def decode_entries(desc: memoryview, n_records: int, payload_start: int, total_bytes: int) -> list[Entry]:
    """Decode the descriptor area. Raises FormatError naming the record on any inconsistency."""
    out: list[Entry] = []
    pos = 0
    end = len(desc)
    limit = total_bytes - COMMIT_BYTES
    for i in range(n_records):
        if pos + ENTRY_BYTES > end:
            raise FormatError(f"record {i} of {n_records} runs past the descriptor area")
        rtype, _flags, name_len, count, vlen, poff, plen, pcrc, _r = _ENTRY.unpack_from(desc, pos)
        if rtype not in RECORD_TYPES:
            raise FormatError(f"record {i} has unknown type {rtype}")
        if name_len > MAX_NAME_BYTES or vlen > MAX_VAR_BYTES or name_len > vlen:
            raise FormatError(f"record {i} declares a name of {name_len} and a body of {vlen} bytes")
        vstart = pos + ENTRY_BYTES
        if vstart + vlen > end:
            raise FormatError(f"record {i} body runs past the descriptor area")
        if plen:
            if poff < payload_start or poff + plen > limit:
                raise FormatError(f"record {i} payload [{poff}, +{plen}) lies outside the epoch's payload area")
        try:
            name = bytes(desc[vstart : vstart + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"record {i} name is not UTF-8") from None
        var = desc[vstart + name_len : vstart + vlen]
        if rtype in (REC_PAGES, REC_RUNS):
            per = 8 if rtype == REC_PAGES else 16
            if count * per != len(var):
                raise FormatError(f"record {i} ({name!r}) declares {count} entries but carries {len(var)} bytes")
        out.append(Entry(rtype, name, count, var, poff, plen, pcrc))
        pos = vstart + align_up(vlen, 8)
    return out


# ------------------------------------------------------------------------------------------------- epochs
@dataclass(frozen=True)
class EpochHeader:
    epoch: int
    n_records: int
    desc_bytes: int
    total_bytes: int
    payload_bytes: int
    flags: int = 0
    desc_crc: int = 0

    def encode(self) -> bytes:
        body = _EPOCH.pack(EPOCH_MAGIC, FORMAT_VERSION, self.flags, self.n_records, self.epoch, self.desc_bytes,
                           self.total_bytes, self.payload_bytes)
        return body + struct.pack("<II", crc32c(body), self.desc_crc)

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> EpochHeader:
        if len(buf) < EPOCH_HEADER_BYTES:
            raise FormatError("epoch header cut short")
        magic, version, flags, n_records, epoch, desc_bytes, total, payload = _EPOCH.unpack_from(buf, 0)
        if magic != EPOCH_MAGIC:
            raise FormatError(f"no epoch magic (found {bytes(magic)!r})")
        crc, desc_crc = struct.unpack_from("<II", buf, _EPOCH.size)
        if crc != crc32c(bytes(buf[: _EPOCH.size])):
            raise FormatError("epoch header checksum mismatch")
        if version != FORMAT_VERSION:
            raise NewerFormatError(f"epoch format version {version} is not supported (this build reads "
                                   f"{FORMAT_VERSION}): a newer concordia-ft wrote it; upgrade to read this log")
        if n_records > MAX_RECORDS or desc_bytes > MAX_DESC_BYTES or total > MAX_EPOCH_BYTES:
            raise FormatError(f"epoch header declares {n_records} records, {desc_bytes} descriptor bytes and "
                              f"{total} total bytes: over the format's bounds")
        if EPOCH_HEADER_BYTES + desc_bytes + payload + COMMIT_BYTES > total:
            raise FormatError(f"epoch header sizes do not add up ({desc_bytes} + {payload} > {total})")
        return cls(epoch, n_records, desc_bytes, total, payload, flags, desc_crc)


def encode_commit(epoch: int, total_bytes: int, desc_crc: int) -> bytes:
    body = _COMMIT.pack(COMMIT_MAGIC, epoch, total_bytes, desc_crc)
    return body + struct.pack("<I", crc32c(body))


def check_commit(buf: bytes | memoryview, epoch: int, total_bytes: int, desc_crc: int) -> None:
    if len(buf) < COMMIT_BYTES:
        raise FormatError("commit marker cut short")
    magic, m_epoch, m_total, m_desc_crc = _COMMIT.unpack_from(buf, 0)
    (crc,) = struct.unpack_from("<I", buf, _COMMIT.size)
    if magic != COMMIT_MAGIC:
        raise FormatError("no commit marker")
    if crc != crc32c(bytes(buf[: _COMMIT.size])):
        raise FormatError("commit marker checksum mismatch")
    if (m_epoch, m_total, m_desc_crc) != (epoch, total_bytes, desc_crc):
        raise FormatError(f"commit marker names epoch {m_epoch} ({m_total} bytes), header says epoch {epoch} "
                          f"({total_bytes} bytes)")


class JSONText(bytes):
    """Metadata its caller encoded as JSON already (from cached fragments: the serving engine's per-step state):
    ``encode_json`` passes it through instead of encoding an object again."""


def encode_json(obj: Any) -> bytes:
    if isinstance(obj, JSONText):
        return bytes(obj)
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode("utf-8")


def decode_json(buf: bytes | memoryview, what: str) -> Any:
    try:
        return json.loads(bytes(buf).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, 5000-digit ints, deep nesting
        raise FormatError(f"{what} is not valid JSON ({e})") from None


def kind_from_code(code: int) -> RegionKind:
    try:
        return KIND_BY_CODE[code]
    except KeyError:
        raise FormatError(f"unknown region kind code {code}") from None
