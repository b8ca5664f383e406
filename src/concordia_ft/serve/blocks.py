"""The KV block pool's bookkeeping: a free list and one block table per request (plain Python, no torch).

Block ids index the engine's KV pool (``kv.KVPool``); block ``b`` holds token slots ``[b * block_size,
(b + 1) * block_size)``. Allocation takes the lowest-numbered free blocks (a heap), so the free list is a pure
function of the block tables: it is never logged, a recovered engine rebuilds it as their complement, and two
engines fed the same requests place every token at the same slot.
Caller mistakes (double free, unknown request) raise ``ValueError``; broken invariants are asserts.
"""

from __future__ import annotations

import heapq


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``n_tokens`` token slots."""
    return -(-n_tokens // block_size)


class BlockPool:
    """``num_blocks`` fixed-size blocks: a free list (lowest id first) and a block table per request id."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be positive")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._free: list[int] = list(range(self.num_blocks))  # a heap
        self._owner: dict[int, str] = {}
        self.tables: dict[str, list[int]] = {}

    @property
    def n_free(self) -> int:
        return len(self._free)

    def free_list(self) -> list[int]:
        return sorted(self._free)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self._free)

    def allocate(self, request_id: str, n_blocks: int) -> list[int]:
        """Append ``n_blocks`` blocks to ``request_id``'s table (creating it); return the new block ids."""
        if n_blocks < 0:
            raise ValueError(f"cannot allocate {n_blocks} blocks")
        if n_blocks > len(self._free):
            raise ValueError(f"request {request_id!r} needs {n_blocks} blocks; {len(self._free)} are free")
        new = [heapq.heappop(self._free) for _ in range(n_blocks)]
        for b in new:
            assert b not in self._owner, f"block {b} was on the free list and owned by {self._owner[b]!r}"
            self._owner[b] = request_id
        self.tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> list[int]:
        """Return every block of ``request_id`` to the free list; returns them."""
        table = self.tables.pop(request_id, None)
        if table is None:
            raise ValueError(f"request {request_id!r} holds no blocks (freed twice, or never allocated)")
        for b in table:
            assert self._owner.pop(b) == request_id, f"block {b} of {request_id!r} had another owner"
        for b in table:
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

    # -- persistence: the block tables ARE the state; the free list is their complement ----------------------
    @classmethod
    def restore(cls, num_blocks: int, block_size: int, tables: dict[str, list[int]]) -> BlockPool:
        """Rebuild a pool from logged block tables; checks that no block is owned twice or out of range."""
        pool = cls(num_blocks, block_size)
        for rid, table in tables.items():
            for b in table:
                if not 0 <= b < num_blocks or b in pool._owner:
                    raise ValueError(f"block {b} of request {rid!r} is out of range or owned twice")
                pool._owner[b] = rid
            pool.tables[rid] = list(table)
        pool._free = [b for b in range(num_blocks) if b not in pool._owner]  # sorted: a valid heap
        return pool
