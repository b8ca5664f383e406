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
