"""BlockPool: exact block ids, ref counts, free-queue order and lazy eviction."""

from __future__ import annotations

import pytest

from kvcache.block_pool import BlockPool, BlockPoolError
from kvcache.prefix_hash import hash_block


def ids(blocks: list) -> list[int]:
    return [block.block_id for block in blocks]


def test_fresh_pool() -> None:
    pool = BlockPool(4)
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [0, 1, 2, 3]
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0


def test_get_new_blocks_pops_head_in_id_order() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.check_invariants()
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3]
    assert pool.usage == 0.75
    with pytest.raises(BlockPoolError, match="only 1 free"):
        pool.get_new_blocks(2)
    pool.check_invariants()


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [3, 4, 2, 1, 0]
    assert pool.num_free_blocks == 5


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(BlockPoolError, match="double free of block 0"):
        pool.free_blocks([block])
    pool.check_invariants()


def test_touch_shared_block_and_free_twice() -> None:
    pool = BlockPool(3)
    [block] = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free_blocks([block])
    pool.check_invariants()
    assert block.ref_count == 1 and pool.free_queue.block_ids() == [1, 2]
    pool.free_blocks([block])
    pool.check_invariants()
    assert block.ref_count == 0 and pool.free_queue.block_ids() == [1, 2, 0]


def test_cached_free_block_revived_by_touch_leaves_queue_middle() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    h0 = hash_block(None, [1, 2])
    pool.cache_full_block(blocks[0], h0)
    pool.free_blocks(reversed(blocks))
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    assert pool.get_cached_block(h0) is blocks[0]  # still cached while free
    pool.touch([blocks[0]])
    pool.check_invariants()
    assert blocks[0].ref_count == 1
    assert pool.free_queue.block_ids() == [2, 3, 1]


def test_eviction_is_lazy_and_drops_the_hash() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    h0, h1 = hash_block(None, [1]), hash_block(None, [2])
    pool.cache_full_block(blocks[0], h0)
    pool.cache_full_block(blocks[1], h1)
    pool.free_blocks([blocks[1], blocks[0]])  # block 1 is evicted first
    assert pool.num_cached_blocks == 2
    [reused] = pool.get_new_blocks(1)
    pool.check_invariants()
    assert reused.block_id == 1 and reused.block_hash is None
    assert pool.get_cached_block(h1) is None
    assert pool.get_cached_block(h0) is blocks[0]


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, [5, 6])
    pool.cache_full_block(a, h)
    pool.cache_full_block(b, h)  # same content computed twice
    pool.check_invariants()
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.cache_full_block(a, h)  # idempotent
    with pytest.raises(BlockPoolError, match="another hash"):
        pool.cache_full_block(a, h + 1)
    pool.check_invariants()


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, 123)
    pool.check_invariants()
    assert block.block_hash is None and pool.get_cached_block(123) is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, 42)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(42) is block
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() is True
    pool.check_invariants()
    assert pool.get_cached_block(42) is None and block.block_hash is None


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    block.ref_count = 0  # freed behind the pool's back: not in the free queue
    with pytest.raises(AssertionError, match="in free queue False"):
        pool.check_invariants()


def test_hash_is_deterministic_and_chained() -> None:
    h = hash_block(None, [1, 2, 3, 4])
    assert h == hash_block(None, [1, 2, 3, 4])
    assert 0 <= h < 2**64
    assert hash_block(h, [5, 6]) != hash_block(None, [5, 6])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert h == hash_block(None, (1, 2, 3, 4))  # any int sequence
    # Pinned values: the same in every process and Python version (no salted str hash).
    assert h == 9603444922966947553
    assert hash_block(h, [5, 6, 7, 8]) == 9122390191182382144


# ------------------------------------------------------------------- the null block (windows)


def test_null_block_is_reserved_and_never_handed_out() -> None:
    pool = BlockPool(4, reserve_null_block=True)
    pool.check_invariants()
    assert pool.null_block is pool.blocks[0]
    assert pool.free_queue.block_ids() == [1, 2, 3]
    assert pool.num_free_blocks == 3 and pool.num_usable_blocks == 3 and pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    pool.check_invariants()
    assert ids(blocks) == [1, 2, 3] and pool.usage == 1.0
    with pytest.raises(BlockPoolError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [1, 2, 3]
    assert pool.reset_prefix_cache() is True  # every usable block is free


def test_null_block_is_never_freed_touched_or_cached() -> None:
    pool = BlockPool(3, reserve_null_block=True)
    null = pool.null_block
    assert null is not None
    with pytest.raises(BlockPoolError, match="never freed"):
        pool.free_blocks([null])
    with pytest.raises(BlockPoolError, match="never touched"):
        pool.touch([null])
    with pytest.raises(BlockPoolError, match="caching free block 0"):
        pool.cache_full_block(null, hash_block(None, [1, 2]))
    pool.check_invariants()
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1, reserve_null_block=True)


def test_invariants_catch_a_null_block_in_use() -> None:
    pool = BlockPool(3, reserve_null_block=True)
    assert pool.null_block is not None
    pool.null_block.ref_count = 1
    with pytest.raises(AssertionError, match="null block 0"):
        pool.check_invariants()
