"""The KV block pool's bookkeeping: block tables, reference counts, the free list and the prefix cache (plain
Python, no torch).

Block ids index the engine's KV pool (``kv.KVPool``); block ``b`` holds token slots ``[b * block_size,
(b + 1) * block_size)``. A block is in exactly one of three states:

- **referenced**: named by one or more block tables (its reference count); more than one only if it is cached;
- **cached, unreferenced**: full, registered in the prefix cache under its hash, on the LRU list (evictable);
- **free**: on the free list (a heap: the lowest id is taken first).

The prefix cache maps a block's **hash** to the block holding its KV: ``block_hash(parent, tokens)``, a BLAKE2b
digest of the previous block's hash and this block's token ids, so equal hashes mean an equal prefix of whole
blocks (vLLM's automatic prefix caching keys blocks the same way). ``lookup`` finds the longest cached prefix of
a request's block hashes, ``share`` appends those blocks to its table; ``allocate`` takes free blocks, then
evicts the least recently released cached blocks. ``free`` releases a table from its last block to its first,
so of blocks released together the tail of a chain is evicted before its head.

Every decision is a pure function of the block tables, the cache's ``(block, hash)`` pairs in registration
order and the LRU list (``state()``, logged with each epoch); reference counts and the free list are derived
(``restore`` rebuilds them and refuses a state in which a block is both free and named, named twice without
being cached, on the LRU list while referenced, or cached under two hashes).
Caller mistakes (double free, unknown request) raise ``ValueError``; broken invariants are asserts.
"""

from __future__ import annotations

import array
import hashlib
import heapq
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..core.format import encode_json

_LITTLE = sys.byteorder == "little" and array.array("i").itemsize == 4


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``n_tokens`` token slots."""
    return -(-n_tokens // block_size)


def block_hash(parent: bytes | None, tokens: Sequence[int] | bytes) -> bytes:
    """The prefix cache's key of a full block: BLAKE2b-128 of the previous block's key and this block's token
    ids (int32 little-endian; ``bytes`` are taken as already encoded). Stable across processes (no seeded
    ``hash()``), so a recovered engine computes the keys the killed one logged."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(tokens if isinstance(tokens, bytes) else _int32le(tokens))
    return h.digest()


def _int32le(ids: Sequence[int]) -> bytes:
    return array.array("i", ids).tobytes() if _LITTLE else b"".join(
        int(t).to_bytes(4, "little", signed=True) for t in ids)


def chain_hashes(ids: Sequence[int], block_size: int, n_blocks: int, known: list[bytes] | None = None
                 ) -> list[bytes]:
    """The keys of the first ``n_blocks`` full blocks of ``ids`` (``known``: keys already computed, extended)."""
    out = list(known or [])
    if len(out) >= n_blocks:
        return out
    lo = len(out) * block_size
    raw = _int32le(ids[lo: n_blocks * block_size])
    step = 4 * block_size
    for j in range(n_blocks - len(out)):
        out.append(block_hash(out[-1] if out else None, raw[j * step: (j + 1) * step]))
    return out


class BlockPool:
    """``num_blocks`` fixed-size blocks: block tables per request id, reference counts, the free list and the
    prefix cache (hash -> block, LRU eviction among unreferenced cached blocks)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be positive")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._free: list[int] = list(range(self.num_blocks))  # a heap
        self._ref = [0] * self.num_blocks
        self.tables: dict[str, list[int]] = {}
        self._hash_of: dict[int, bytes] = {}  # cached block -> its key, in registration order
        self._block_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recent first
        self._version = 0  # bumped on every change of the cache or the LRU (state_json's cache key)
        self._json: tuple[int, bytes] = (-1, b"")
        self.hits = 0  # blocks shared by lookup hits (counters for the caller; not state)
        self.evictions = 0

    # -- counts ------------------------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        """Blocks on the free list (neither named nor cached)."""
        return len(self._free)

    @property
    def n_cached(self) -> int:
        return len(self._hash_of)

    @property
    def n_evictable(self) -> int:
        """Cached blocks no table names (``allocate`` may evict them)."""
        return len(self._lru)

    @property
    def n_available(self) -> int:
        """What ``allocate`` can hand out: free plus evictable."""
        return len(self._free) + len(self._lru)

    def free_list(self) -> list[int]:
        return sorted(self._free)

    def lru(self) -> list[int]:
        return list(self._lru)

    def ref(self, block: int) -> int:
        return self._ref[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= self.n_available

    # -- allocation --------------------------------------------------------------------------------------
    def allocate(self, request_id: str, n_blocks: int) -> list[int]:
        """Append ``n_blocks`` blocks to ``request_id``'s table (creating it); return the new block ids. Free
        blocks first (lowest id first), then cached blocks no table names, least recently released first
        (evicted from the cache)."""
        if n_blocks < 0:
            raise ValueError(f"cannot allocate {n_blocks} blocks")
        if n_blocks > self.n_available:
            raise ValueError(f"request {request_id!r} needs {n_blocks} blocks; {self.n_available} are free or "
                             "evictable")
        new = []
        for _ in range(n_blocks):
            if self._free:
                b = heapq.heappop(self._free)
            else:
                b, _none = self._lru.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self._version += 1
                self.evictions += 1
            assert self._ref[b] == 0 and b not in self._hash_of, f"block {b} was handed out while in use"
            self._ref[b] = 1
            new.append(b)
        self.tables.setdefault(request_id, []).extend(new)
        return new

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` found in the cache (nothing changes)."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def share(self, request_id: str, blocks: Sequence[int]) -> None:
        """Append cached ``blocks`` (a ``lookup`` result) to ``request_id``'s table (creating it), taking a
        reference on each (an unreferenced one leaves the LRU list)."""
        for b in blocks:
            if b not in self._hash_of:
                raise ValueError(f"block {b} is not cached: only cached blocks are shared")
        table = self.tables.setdefault(request_id, [])
        for b in blocks:
            if self._ref[b] == 0:
                del self._lru[b]
                self._version += 1
            self._ref[b] += 1
            table.append(b)
        self.hits += len(blocks)

    def cache(self, block: int, key: bytes) -> bool:
        """Register a full, referenced ``block`` under ``key``. False (nothing changes) when the key is cached
        already (another block holds the same prefix: this one stays private) or the block is cached."""
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is not named by any table: only a live block is registered")
        if key in self._block_of or block in self._hash_of:
            return False
        self._hash_of[block] = key
        self._block_of[key] = block
        self._version += 1
        return True

    def free(self, request_id: str) -> list[int]:
        """Release every block of ``request_id``'s table (last block first); returns the table. A block no
        table names any more goes to the LRU list if cached, else to the free list."""
        table = self.tables.pop(request_id, None)
        if table is None:
            raise ValueError(f"request {request_id!r} holds no blocks (freed twice, or never allocated)")
        for b in reversed(table):
            assert self._ref[b] > 0, f"block {b} of {request_id!r} was not referenced"
            self._ref[b] -= 1
            if self._ref[b]:
                continue
            if b in self._hash_of:
                self._lru[b] = None
                self._version += 1
            else:
                heapq.heappush(self._free, b)
        return table

    def slot(self, request_id: str, position: int) -> int:
        """The pool slot of token ``position`` of ``request_id``."""
        table = self.tables[request_id]
        blk, off = divmod(position, self.block_size)
        if blk >= len(table):
            raise ValueError(f"position {position} of {request_id!r} is past its {len(table)} blocks")
        return table[blk] * self.block_size + off

    def slots(self, request_id: str, start: int, stop: int) -> list[int]:
        return [self.slot(request_id, p) for p in range(start, stop)]

    # -- persistence: tables + cache + LRU are the state; ref counts and the free list are derived ------------
    def state(self) -> dict[str, Any]:
        """The cache and its LRU list (the tables are logged with their requests)."""
        return {"cached": [[b, h.hex()] for b, h in self._hash_of.items()], "lru": list(self._lru)}

    def state_json(self) -> bytes:
        """``encode_json(self.state())``, encoded again only after the cache or the LRU list changed."""
        if self._json[0] != self._version:
            self._json = (self._version, encode_json(self.state()))
        return self._json[1]

    @classmethod
    def restore(cls, num_blocks: int, block_size: int, tables: dict[str, list[int]],
                cached: Sequence[Sequence[Any]] = (), lru: Sequence[int] = ()) -> BlockPool:
        """Rebuild a pool from logged block tables and cache state (``state()``). Raises ``ValueError`` naming
        the first inconsistency: a block out of range, named by two tables without being cached, cached twice
        or under a key another block holds, an LRU entry that is not an unreferenced cached block (or a cached
        unreferenced block missing from it)."""
        pool = cls(num_blocks, block_size)
        for rid, table in tables.items():
            for b in table:
                if not 0 <= b < num_blocks:
                    raise ValueError(f"block {b} of request {rid!r} is out of range (the pool has {num_blocks})")
                pool._ref[b] += 1
            pool.tables[rid] = list(table)
        for b, key in cached:
            b = int(b)
            h = bytes.fromhex(str(key))
            if not 0 <= b < num_blocks:
                raise ValueError(f"cached block {b} is out of range (the pool has {num_blocks})")
            if b in pool._hash_of or h in pool._block_of:
                raise ValueError(f"cached block {b} (key {h.hex()}) is listed twice or its key names two blocks")
            pool._hash_of[b] = h
            pool._block_of[h] = b
        for rid, table in tables.items():
            for b in table:
                if pool._ref[b] > 1 and b not in pool._hash_of:
                    raise ValueError(f"block {b} is named by {pool._ref[b]} tables (request {rid!r} among them) "
                                     "but is not cached: it is owned twice")
        for b in lru:
            b = int(b)
            if b not in pool._hash_of or pool._ref[b] or b in pool._lru:
                raise ValueError(f"LRU entry {b} is not an unreferenced cached block (or is listed twice)")
            pool._lru[b] = None
        lost = [b for b in pool._hash_of if not pool._ref[b] and b not in pool._lru]
        if lost:
            raise ValueError(f"cached blocks {lost[:8]} are named by no table and missing from the LRU list")
        pool._free = [b for b in range(num_blocks) if not pool._ref[b] and b not in pool._hash_of]  # sorted: a heap
        return pool
