"""The block pool: states, reference counts, copy-on-write, eviction order."""

from __future__ import annotations

import pytest

from headroom.engine.block_pool import BlockPool, NoFreeBlocks
from headroom.engine.prefix_cache import ROOT_REF, PrefixCache


def states(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_used, pool.num_cached


def caching_pool(num_blocks: int) -> BlockPool:
    return BlockPool(num_blocks, PrefixCache(num_blocks))


def cache_block(pool: BlockPool, block_id: int, token: int, block_size: int = 2) -> None:
    """Register a block as the first block of a one-block prefix `[token] * block_size`."""
    assert pool.cache is not None
    tokens = [token] * block_size
    assert pool.cache.insert(block_id, token, ROOT_REF, tokens, None) is not None


def test_fresh_pool_is_all_free_and_hands_out_distinct_blocks() -> None:
    pool = BlockPool(8)
    assert states(pool) == (8, 0, 0)
    ids = [pool.allocate() for _ in range(8)]
    assert sorted(ids) == list(range(8))
    assert all(pool.ref_counts[b] == 1 for b in ids)
    assert states(pool) == (0, 8, 0)
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_free_returns_a_block_and_a_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    pool.free(b)
    assert states(pool) == (2, 0, 0) and pool.ref_counts[b] == 0
    with pytest.raises(ValueError, match="freed more times"):
        pool.free(b)
    assert states(pool) == (2, 0, 0)


def test_sharing_counts_references_and_the_last_free_releases() -> None:
    pool = BlockPool(4)
    b = pool.allocate()
    pool.share(b)
    pool.share(b)
    assert pool.ref_counts[b] == 3
    pool.free(b)
    pool.free(b)
    assert pool.num_used == 1 and pool.ref_counts[b] == 1
    pool.free(b)
    assert states(pool) == (4, 0, 0)


def test_sharing_a_free_block_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="is free"):
        pool.share(0)
    assert states(pool) == (2, 0, 0)


def test_copy_on_write_only_copies_shared_blocks() -> None:
    pool = BlockPool(4)
    b = pool.allocate()
    assert pool.copy_on_write(b) == b  # sole owner writes in place
    pool.share(b)
    dst = pool.copy_on_write(b)
    assert dst != b
    assert pool.ref_counts[b] == 1 and pool.ref_counts[dst] == 1
    assert states(pool) == (2, 2, 0)


def test_hashed_block_is_cached_on_release_and_revived_without_copy() -> None:
    pool = caching_pool(4)
    b = pool.allocate()
    cache_block(pool, b, 7)
    pool.free(b)
    assert states(pool) == (3, 0, 1)
    assert pool.num_available == 4
    pool.share(b)  # a prefix hit: the same physical block, content untouched
    assert states(pool) == (3, 1, 0) and pool.ref_counts[b] == 1
    assert pool.cache is not None and pool.cache._content[b][2] == [7, 7]


def test_allocation_prefers_free_blocks_over_evicting_cached_ones() -> None:
    pool = caching_pool(3)
    a = pool.allocate()
    cache_block(pool, a, 1)
    pool.free(a)
    others = [pool.allocate(), pool.allocate()]
    assert a not in others
    assert pool.cache is not None and pool.cache.is_cached(a)
    assert states(pool) == (0, 2, 1)
    # Only now does the pool evict, and it reuses the cached block.
    assert pool.allocate() == a
    assert not pool.cache.is_cached(a)
    assert pool.cache.evictions_total == 1


def test_eviction_is_least_recently_used_first() -> None:
    pool = caching_pool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for i, b in enumerate(blocks):
        cache_block(pool, b, 10 + i)
    for b in (blocks[2], blocks[0], blocks[1]):  # parked in this order
        pool.free(b)
    pool.share(blocks[2])  # a hit pulls it out of the LRU list...
    pool.free(blocks[2])  # ...and releasing it makes it the most recent
    assert pool.cache is not None
    assert list(pool.cache._parked) == [blocks[0], blocks[1], blocks[2]]
    assert [pool.allocate() for _ in range(3)] == [blocks[0], blocks[1], blocks[2]]


def test_without_prefix_caching_released_blocks_are_free() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    pool.free(b)
    assert states(pool) == (2, 0, 0) and pool.cache is None


def test_a_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0)
