"""CRC32C, the log's one checksum: every CRC the package computes on the host goes through this module.

- ``crc32c``: the ``crc32c`` package (hardware instructions where the CPU has them).
- ``crc32c_buffers`` / ``crc32c_native``: the C extension's CRC32C (core/_crc32c.h), for many buffers in one
  call with the GIL released, optionally while their DMA is still landing.
- the GF(2) arithmetic that combines CRCs (``multmodp``, ``crc32c_shift``, ``crc32c_combine``) and turns the raw
  CRC a GPU kernel computes into the standard one (``raw_to_crc32c``). The C side of the same arithmetic is
  core/_crc32c_gf2.h, shared by the C extension and the GPU kernel (cuda/crc.py).

The log stores one CRC32C per payload, and one payload can be a whole prompt's KV (hundreds of MB in ONE
record), so verifying "many epochs in parallel" is not enough: a payload is cut into ``chunk_bytes`` pieces
whose checksums are combined exactly (``crc32c_combine``: crc(A || B) from crc(A), crc(B) and len(B), the
GF(2) method zlib uses for crc32_combine, here for the Castagnoli polynomial).

The ``crc32c`` package releases the GIL around the checksum loop of buffers >= 32 KiB by default
(``gil_release_mode=-1``); worker threads pass ``gil_release_mode=1`` (always release: every chunk they get
is large) and the serial path passes 0 for the small headers and descriptors it checks, where a release and
re-acquire would cost more than the checksum.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c

from ..errors import ConfigError

try:  # the C extension of core/ (core/_slotlog.c); its CRC32C is core/_crc32c.h
    from . import _slotlog as _native  # type: ignore[attr-defined]
    _NATIVE_WHY = ""
except ImportError as _e:  # no compiler at install time: the crc32c package does all the work
    _native = None
    _NATIVE_WHY = f"not built: {_e}"

POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected
_TOP = 1 << 31  # x^0 in the reflected representation
_MASK = 0xFFFFFFFF


def multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (reflected bit order); core/_crc32c_gf2.h is the same in C."""
    m = _TOP
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
        if not m:
            return p


def _x2n_table() -> list[int]:
    out = []
    p = _TOP >> 1  # x^1
    for _ in range(32):
        out.append(p)
        p = multmodp(p, p)
    return out


_X2N = _x2n_table()  # _X2N[k] = x^(2^k) mod p


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) mod p."""
    p = _TOP
    while n:
        if n & 1:
            p = multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_shift(nbytes: int) -> int:
    """The operator that appends ``nbytes`` bytes to a CRC (see ``crc32c_combine``); reuse it per length."""
    if nbytes < 0:
        raise ValueError(f"a length cannot be negative ({nbytes})")
    return _x2nmodp(nbytes, 3)


def crc32c_combine(crc1: int, crc2: int, len2: int, shift: int | None = None) -> int:
    """CRC32C of A || B from crc1 = CRC32C(A), crc2 = CRC32C(B) and len2 = len(B).

    ``shift`` may be ``crc32c_shift(len2)`` computed once for many combines of equal-length pieces."""
    op = crc32c_shift(len2) if shift is None else shift
    return multmodp(op, crc1) ^ crc2


def raw_to_crc32c(raw: int, nbytes: int, shift: int | None = None) -> int:
    """The standard CRC32C (register from ~0, final xor ~0) of a message of ``nbytes`` from its raw CRC
    (register from 0, no final xor): ``raw ^ x^(8n) * 0xFFFFFFFF ^ 0xFFFFFFFF``. ``shift``: ``crc32c_shift(nbytes)``."""
    op = crc32c_shift(nbytes) if shift is None else shift
    return raw ^ multmodp(op, _MASK) ^ _MASK


def raw_crc(data: bytes | memoryview) -> int:
    """The raw CRC (register from 0, no final xor) of ``data``, from the standard one (a reference)."""
    return raw_to_crc32c(crc32c(data), memoryview(data).nbytes)


def crc32c(data: bytes | bytearray | memoryview, value: int = 0, *, release_gil: bool | None = None) -> int:
    """CRC32C of ``data``. ``release_gil``: None = the package's default (release from 32 KiB), True = always
    (worker threads), False = never (small buffers on the thread that holds the GIL anyway)."""
    mode = -1 if release_gil is None else int(release_gil)
    return int(_crc32c.crc32c(data, value, gil_release_mode=mode))


def native_available() -> bool:
    """True when the C extension (and with it ``crc32c_buffers``) is built."""
    return _native is not None


def native_status() -> str:
    """One line: which CRC32C the C extension uses (the SSE4.2 instruction or a table), or why it is absent."""
    return f"c (crc32c: {_native.crc_impl()})" if _native is not None else f"python ({_NATIVE_WHY})"


def crc32c_buffers(buffers: Any, *, threads: int = 8, piece: int = 1 << 20, flags_address: int = 0,
                   gates: Any = (), timeout_s: float = 2.0) -> list[int] | None:
    """CRC32C of each buffer, in one C call with the GIL released: the buffers are cut into ``piece``-byte
    pieces that ``threads`` threads (the caller's included) checksum, and each buffer's pieces are combined.

    ``gates`` (buffer index, end offset, flag index, tag): bytes of that buffer below ``end`` are only read once
    the 32-bit host word ``flags_address[flag]`` equals ``tag`` (a DMA still landing: the GPU's stream writes the
    word after each chunk), so the checksum runs while the copy is in flight. None when a gate did not open
    within ``timeout_s`` (then wait for the copies and call again without gates)."""
    if _native is None:
        raise ConfigError(f"the C extension is {_NATIVE_WHY}; build it with scripts/build_ext.sh")
    out = _native.crc32c_buffers(list(buffers), int(threads), int(piece), int(flags_address),
                                 [tuple(int(x) for x in g) for g in gates], int(timeout_s * 1e9))
    return None if out is None else [int(c) for c in out]


def crc32c_native(data: Any, value: int = 0) -> int:
    """The C extension's CRC32C of ``data`` (the one its writer stores; tests compare it with ``crc32c``)."""
    if _native is None:
        raise ConfigError(f"the C extension is {_NATIVE_WHY}; build it with scripts/build_ext.sh")
    return int(_native.crc32c(data, value))


@dataclass(frozen=True)
class ChecksumItem:
    """One buffer with the checksum it must have; ``key`` orders failures (the earliest one is reported)."""

    key: tuple[int, ...]
    data: memoryview
    expected: int


def first_mismatch(items: Sequence[ChecksumItem], *, pool: Executor | None = None, workers: int = 1,
                   chunk_bytes: int = 8 << 20) -> ChecksumItem | None:
    """The item with the smallest ``key`` whose CRC32C differs from ``expected``, or None when all match.

    Without a pool (or with one worker) the items are checked in key order and the first mismatch ends the
    check. With a pool every item is checked: large ones in ``chunk_bytes`` pieces spread over ``workers``
    lists of about equal bytes, so one huge payload keeps every worker busy."""
    ordered = sorted(items, key=lambda it: it.key)
    if pool is None or workers <= 1:
        for it in ordered:
            if crc32c(it.data, release_gil=it.data.nbytes >= 32 << 10) != it.expected:
                return it
        return None
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    pieces: list[tuple[int, int, memoryview]] = []  # (item index, piece index, bytes)
    n_pieces = []
    for i, it in enumerate(ordered):
        n = max(1, -(-it.data.nbytes // chunk_bytes))
        n_pieces.append(n)
        pieces.extend((i, j, it.data[j * chunk_bytes : (j + 1) * chunk_bytes]) for j in range(n))
    # greedy balance by bytes: biggest pieces first onto the least loaded worker
    loads = [0] * workers
    shares: list[list[tuple[int, int, memoryview]]] = [[] for _ in range(workers)]
    for p in sorted(pieces, key=lambda p: -p[2].nbytes):
        w = loads.index(min(loads))
        shares[w].append(p)
        loads[w] += p[2].nbytes
    crcs: dict[tuple[int, int], int] = {}
    for part in pool.map(_checksum_pieces, [s for s in shares if s]):
        crcs.update(part)
    full_shift = crc32c_shift(chunk_bytes)
    for i, it in enumerate(ordered):
        crc = crcs[(i, 0)]
        for j in range(1, n_pieces[i]):
            tail = it.data.nbytes - j * chunk_bytes
            shift = full_shift if tail >= chunk_bytes else None
            crc = crc32c_combine(crc, crcs[(i, j)], min(chunk_bytes, tail), shift)
        if crc != it.expected:
            return it
    return None


def _checksum_pieces(share: list[tuple[int, int, memoryview]]) -> dict[tuple[int, int], int]:
    return {(i, j): crc32c(data, release_gil=True) for i, j, data in share}


def crc32c_parallel(data: memoryview, pool: Executor | None, *, chunk_bytes: int = 8 << 20,
                    workers: int = 8) -> int:
    """CRC32C of one large buffer, its ``chunk_bytes`` pieces checksummed on ``pool`` and combined exactly.
    Small buffers (or no pool) are checksummed on this thread."""
    n = data.nbytes
    if pool is None or n < 2 * chunk_bytes:
        return crc32c(data, release_gil=n >= 32 << 10)
    per = max(chunk_bytes, -(-n // workers))
    per = -(-per // 4096) * 4096
    pieces = [data[i: i + per] for i in range(0, n, per)]
    crcs = list(pool.map(lambda v: crc32c(v, release_gil=True), pieces))
    crc = crcs[0]
    shift = crc32c_shift(per)
    for piece, c in zip(pieces[1:], crcs[1:], strict=True):
        crc = crc32c_combine(crc, c, piece.nbytes, shift if piece.nbytes == per else None)
    return crc
