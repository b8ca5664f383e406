"""The KV block pool's bookkeeping, exactly (no torch)."""

from __future__ import annotations

import pytest

from concordia_ft.serve.blocks import BlockPool, blocks_for


def test_allocate_lowest_first_and_reuse_after_free() -> None:
    pool = BlockPool(8, 4)
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 2) == [3, 4]
    assert pool.free("a") == [0, 1, 2]
    assert pool.free_list() == [0, 1, 2, 5, 6, 7]
    assert pool.allocate("c", 4) == [0, 1, 2, 5]
    assert pool.tables == {"b": [3, 4], "c": [0, 1, 2, 5]}
    assert pool.slot("c", 13) == 5 * 4 + 1 and pool.slots("b", 3, 6) == [15, 16, 17]
    assert pool.n_free == 2


def test_caller_mistakes_are_value_errors() -> None:
    pool = BlockPool(4, 2)
    pool.allocate("a", 4)
    with pytest.raises(ValueError, match="needs 1 blocks; 0 are free"):
        pool.allocate("b", 1)
    pool.free("a")
    with pytest.raises(ValueError, match="freed twice"):
        pool.free("a")
    pool.allocate("a", 1)
    with pytest.raises(ValueError, match="past its 1 blocks"):
        pool.slot("a", 2)


def test_restore_rebuilds_the_free_list_and_rejects_double_owners() -> None:
    pool = BlockPool(10, 4)
    pool.allocate("a", 3)
    pool.allocate("b", 4)
    pool.free("a")
    pool.allocate("c", 2)
    again = BlockPool.restore(10, 4, pool.tables)
    assert again.free_list() == pool.free_list() == [2, 7, 8, 9]
    assert again.allocate("d", 2) == pool.allocate("d", 2) == [2, 7]
    with pytest.raises(ValueError, match="owned twice"):
        BlockPool.restore(10, 4, {"a": [1, 2], "b": [2]})
    with pytest.raises(ValueError, match="out of range"):
        BlockPool.restore(10, 4, {"a": [10]})


def test_blocks_for() -> None:
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


# -- prefix cache: shared full blocks, reference counts, LRU eviction ------------------------------------------

def _keys(ids: list[int], bs: int = 4) -> list[bytes]:
    from concordia_ft.serve.blocks import chain_hashes

    return chain_hashes(ids, bs, len(ids) // bs)


def _cached_run(pool: BlockPool, rid: str, ids: list[int]) -> list[int]:
    """What the engine does for a request that computes every full block of ``ids``: hit, allocate, register."""
    keys = _keys(ids, pool.block_size)
    hit = pool.lookup(keys)
    pool.share(rid, hit)
    pool.allocate(rid, blocks_for(len(ids), pool.block_size) - len(hit))
    for i, k in enumerate(keys):
        pool.cache(pool.tables[rid][i], k)
    return hit


def test_block_hash_is_chained_and_stable() -> None:
    from concordia_ft.serve.blocks import block_hash, chain_hashes

    a = chain_hashes(list(range(12)), 4, 3)
    assert a[0] == block_hash(None, [0, 1, 2, 3]) and a[1] == block_hash(a[0], [4, 5, 6, 7])
    assert len(a[0]) == 16 and len(set(a)) == 3  # 128-bit digests
    # the same block after another prefix has another key; extending a known chain computes only the rest
    assert chain_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4, 2)[1] != a[1]
    assert chain_hashes(list(range(12)), 4, 3, known=a[:1]) == a
    # pinned: a recovered process must compute the keys the killed one logged (no per-process hash seed)
    assert block_hash(None, [1, 2, 3]).hex() == block_hash(None, (1, 2, 3)).hex()


def test_hits_share_blocks_and_count_references() -> None:
    pool = BlockPool(10, 4)
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert _cached_run(pool, "a", a) == []
    assert pool.tables["a"] == [0, 1, 2] and pool.n_cached == 2
    b = a[:8] + [7, 7, 7]  # the same 2 full blocks, then its own
    assert _cached_run(pool, "b", b) == [0, 1]
    assert pool.tables["b"] == [0, 1, 3]
    assert [pool.ref(i) for i in range(4)] == [2, 2, 1, 1]
    assert pool.hits == 2 and pool.n_free == 6
    assert pool.free("a") == [0, 1, 2]
    assert [pool.ref(i) for i in range(4)] == [1, 1, 0, 1]
    assert pool.lru() == [] and pool.free_list() == [2, 4, 5, 6, 7, 8, 9]  # 0, 1 still named by b
    assert pool.free("b") == [0, 1, 3]
    assert pool.lru() == [1, 0]  # released last block first: the chain's tail is evicted before its head
    assert pool.free_list() == [2, 3, 4, 5, 6, 7, 8, 9] and pool.n_available == 10


def test_a_duplicate_block_stays_private() -> None:
    pool = BlockPool(8, 4)
    ids = [5, 6, 7, 8, 1]
    pool.allocate("a", 2)
    pool.allocate("b", 2)  # both computed the same block before either was cached
    k = _keys(ids)[0]
    assert pool.cache(pool.tables["a"][0], k) and not pool.cache(pool.tables["b"][0], k)
    assert pool.lookup([k]) == [0]
    pool.free("b")
    assert pool.free_list() == [2, 3, 4, 5, 6, 7] and pool.lru() == []  # b's copy went back to the free list
    with pytest.raises(ValueError, match="not named by any table"):
        pool.cache(2, b"x" * 16)
    with pytest.raises(ValueError, match="not cached"):
        pool.share("c", [3])


def test_eviction_takes_free_blocks_first_then_least_recently_released() -> None:
    pool = BlockPool(6, 2)
    _cached_run(pool, "a", [1, 2, 3, 4])  # blocks 0, 1
    _cached_run(pool, "b", [5, 6, 7, 8])  # blocks 2, 3
    pool.free("a")
    pool.free("b")
    assert pool.lru() == [1, 0, 3, 2] and pool.free_list() == [4, 5]
    assert pool.allocate("c", 3) == [4, 5, 1]  # the free list, then the LRU head (a's tail block)
    assert pool.evictions == 1 and pool.n_cached == 3
    assert pool.lookup(_keys([1, 2, 3, 4], 2)) == [0]  # a's first block is still cached, its second is gone
    hit = _cached_run(pool, "d", [5, 6, 7, 8, 9])  # b's chain: a hit takes its blocks off the LRU list
    assert hit == [2, 3] and pool.tables["d"] == [2, 3, 0] and pool.lru() == []
    assert pool.evictions == 2 and pool.lookup(_keys([1, 2], 2)) == []  # block 0 was the last evictable
    assert not pool.can_allocate(1)
    with pytest.raises(ValueError, match="needs 1 blocks; 0 are free or evictable"):
        pool.allocate("e", 1)


def test_restore_rebuilds_refcounts_free_list_and_lru_and_continues_alike() -> None:
    pool = BlockPool(12, 4)
    _cached_run(pool, "a", list(range(10, 23)))
    _cached_run(pool, "b", list(range(10, 18)) + [1, 2, 3, 4, 5])
    _cached_run(pool, "c", list(range(40, 49)))
    pool.free("c")
    pool.free("a")
    st = pool.state()
    # a: blocks 0-3 (0-2 cached); b: hits 0, 1, then 4 (cached), 5; c: 6, 7 (cached), 8
    assert st["lru"] == [7, 6, 2] and [b for b, _ in st["cached"]] == [0, 1, 2, 4, 6, 7]
    again = BlockPool.restore(12, 4, pool.tables, st["cached"], st["lru"])
    assert again.state() == st and again.free_list() == pool.free_list() == [3, 8, 9, 10, 11]
    assert [again.ref(i) for i in range(12)] == [pool.ref(i) for i in range(12)]
    assert again.state_json() == pool.state_json()
    for p in (pool, again):  # the same next decisions: allocations, evictions, hits
        assert p.allocate("d", 6) == [3, 8, 9, 10, 11, 7]
        assert p.lookup(_keys(list(range(40, 48)))) == [6]  # c's head is still cached, its tail was evicted
    assert again.state() == pool.state()


def test_restore_refuses_inconsistent_cache_state() -> None:
    pool = BlockPool(8, 4)
    _cached_run(pool, "a", list(range(9)))
    st = pool.state()
    h0, h1 = st["cached"][0][1], st["cached"][1][1]
    bad = [
        ({"a": [0, 1, 2], "b": [2]}, st["cached"], [], "owned twice"),
        ({"a": [0, 1, 2]}, [[0, h0], [3, h0]], [], "listed twice or its key"),
        ({"a": [0, 1, 2]}, st["cached"], [1], "not an unreferenced cached block"),
        ({"a": [2]}, st["cached"], [0], "missing from the LRU"),
        ({"a": [0, 1, 2]}, [[9, h1]], [], "out of range"),
    ]
    for tables, cached, lru, msg in bad:
        with pytest.raises(ValueError, match=msg):
            BlockPool.restore(8, 4, tables, cached, lru)
    ok = BlockPool.restore(8, 4, {"a": [0, 1, 2], "b": [0, 1, 3]}, st["cached"], [])
    assert [ok.ref(i) for i in range(4)] == [2, 2, 1, 1]
