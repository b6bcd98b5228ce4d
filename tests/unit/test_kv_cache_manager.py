"""KVCacheManager: exact block tables, ref counts and free-queue order through allocate /
prefix hit / free / evict, with the invariants checked after every operation."""

from __future__ import annotations

import pytest

from kvcache.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvcache.prefix_hash import chain_root, hash_block

A_TOKENS = list(range(100, 110))  # 10 tokens: blocks of 4 -> 2 full + 1 partial


def manager(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    kv.check_invariants()
    return kv


def free_order(kv: KVCacheManager) -> list[int]:
    return kv.pool.free_queue.block_ids()


def refs(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [kv.pool.blocks[i].ref_count for i in block_ids]


def run_prefill(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Admit with a prefix lookup, allocate the whole prompt, mark it computed."""
    computed = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(request_id, len(tokens), computed)
    kv.check_invariants()
    kv.cache_full_blocks(request_id, tokens, len(tokens))
    kv.check_invariants()


def test_allocate_cache_free_then_prefix_hit() -> None:
    kv = manager()
    run_prefill(kv, "A", A_TOKENS)
    assert kv.block_table("A") == [0, 1, 2]
    assert free_order(kv) == [3, 4, 5, 6, 7]
    assert kv.usage == 3 / 8
    # Blocks 0 and 1 are full and computed; block 2 holds 2 tokens and stays uncached.
    h0 = hash_block(None, A_TOKENS[0:4])
    h1 = hash_block(h0, A_TOKENS[4:8])
    assert [kv.pool.blocks[i].block_hash for i in range(3)] == [h0, h1, None]

    kv.free("A")
    kv.check_invariants()
    assert free_order(kv) == [3, 4, 5, 6, 7, 2, 1, 0]  # tail of A evicted first
    assert kv.block_table("A") == []

    b_tokens = A_TOKENS[:8] + [900, 901]
    computed = kv.get_computed_blocks(b_tokens)
    assert [b.block_id for b in computed.blocks] == [0, 1] and computed.num_tokens == 8
    assert kv.allocate_slots("B", 10, computed)
    kv.check_invariants()
    assert kv.block_table("B") == [0, 1, 3]
    assert refs(kv, [0, 1, 3]) == [1, 1, 1]
    assert free_order(kv) == [4, 5, 6, 7, 2]
    assert kv.prefix_cache_queried_tokens == 10 + 10  # A's admission, then B's
    assert kv.prefix_cache_hit_tokens == 8


def test_running_requests_share_blocks() -> None:
    kv = manager()
    run_prefill(kv, "A", A_TOKENS)
    run_prefill(kv, "B", A_TOKENS[:8] + [7])
    assert kv.block_table("B") == [0, 1, 3]
    assert refs(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    kv.free("A")
    kv.check_invariants()
    assert refs(kv, [0, 1, 2]) == [1, 1, 0]
    assert free_order(kv) == [4, 5, 6, 7, 2]  # only A's private tail came back
    kv.free("B")
    kv.check_invariants()
    assert free_order(kv) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_hit_never_covers_the_last_token() -> None:
    kv = manager()
    run_prefill(kv, "A", A_TOKENS[:8])  # exactly two full blocks, both cached
    kv.free("A")
    computed = kv.get_computed_blocks(A_TOKENS[:8])
    assert [b.block_id for b in computed.blocks] == [0] and computed.num_tokens == 4
    assert kv.get_computed_blocks(A_TOKENS[:9]).num_tokens == 8
    assert kv.get_computed_blocks(A_TOKENS[:1]).num_tokens == 0


def test_hit_stops_at_first_differing_block() -> None:
    kv = manager()
    run_prefill(kv, "A", A_TOKENS)
    changed = A_TOKENS[:4] + [0, 0, 0, 0] + A_TOKENS[8:]
    computed = kv.get_computed_blocks(changed)
    assert [b.block_id for b in computed.blocks] == [0]
    # Same second block, different first block: the chained hash refuses it.
    changed_first = [0, 0, 0, 0] + A_TOKENS[4:]
    assert kv.get_computed_blocks(changed_first).blocks == []


def test_failed_allocation_changes_nothing() -> None:
    kv = manager(num_blocks=4)
    run_prefill(kv, "A", A_TOKENS)  # blocks [0, 1, 2]; 0 and 1 cached
    kv.free("A")
    assert free_order(kv) == [3, 2, 1, 0]
    queried = kv.prefix_cache_queried_tokens
    b_tokens = A_TOKENS[:8] + list(range(200, 212))  # 20 tokens = 5 blocks, 2 hit
    computed = kv.get_computed_blocks(b_tokens)
    assert computed.num_tokens == 8
    # Needs 3 new blocks; 4 free but 2 of them are the hit itself -> only 2 to give.
    assert not kv.allocate_slots("B", 20, computed)
    kv.check_invariants()
    assert free_order(kv) == [3, 2, 1, 0] and kv.block_table("B") == []
    assert kv.prefix_cache_queried_tokens == queried  # a failed admission is not counted
    assert kv.allocate_slots("B", 16, computed)  # 4 blocks: exactly the pool
    kv.check_invariants()
    assert kv.block_table("B") == [0, 1, 3, 2]
    assert kv.num_free_blocks == 0 and kv.usage == 1.0
    assert not kv.allocate_slots("B", 17)
    kv.check_invariants()
    assert kv.block_table("B") == [0, 1, 3, 2]


def test_growing_table_and_incremental_hashes() -> None:
    kv = manager(num_blocks=4)
    tokens = list(range(1, 14))
    assert kv.allocate_slots("A", 5, ComputedBlocks())  # prefill chunk of 5 tokens
    kv.cache_full_blocks("A", tokens, 5)
    kv.check_invariants()
    assert kv.block_table("A") == [0, 1]
    h0 = hash_block(None, tokens[0:4])
    assert kv.pool.blocks[0].block_hash == h0 and kv.pool.blocks[1].block_hash is None
    for num_tokens in range(6, 14):  # then one token at a time
        assert kv.allocate_slots("A", num_tokens)
        kv.cache_full_blocks("A", tokens, num_tokens)
        kv.check_invariants()
    assert kv.block_table("A") == [0, 1, 2, 3]
    h1 = hash_block(h0, tokens[4:8])
    h2 = hash_block(h1, tokens[8:12])
    assert [kv.pool.blocks[i].block_hash for i in range(4)] == [h0, h1, h2, None]
    assert kv.allocate_slots("A", 16)  # still inside block 3: no new block
    assert not kv.allocate_slots("A", 17)
    kv.check_invariants()


def test_reusing_a_cached_free_block_evicts_it() -> None:
    kv = manager(num_blocks=3)
    run_prefill(kv, "A", A_TOKENS)  # [0, 1, 2]
    kv.free("A")
    assert free_order(kv) == [2, 1, 0]
    assert kv.allocate_slots("C", 8)  # takes 2 (uncached) and 1 (cached: evicted)
    kv.check_invariants()
    assert kv.block_table("C") == [2, 1]
    assert kv.pool.blocks[1].block_hash is None
    computed = kv.get_computed_blocks(A_TOKENS)
    assert [b.block_id for b in computed.blocks] == [0]  # the chain breaks at block 1


def test_allocation_revives_only_hit_blocks() -> None:
    kv = manager(num_blocks=4)
    run_prefill(kv, "A", A_TOKENS)
    kv.free("A")
    run_prefill(kv, "B", A_TOKENS[:8] + [5])  # hits [0, 1], takes block 3 from the head
    assert kv.block_table("B") == [0, 1, 3]
    assert free_order(kv) == [2]


def test_caching_disabled() -> None:
    kv = manager(caching=False)
    run_prefill(kv, "A", A_TOKENS)
    kv.free("A")
    computed = kv.get_computed_blocks(A_TOKENS)
    assert computed.blocks == [] and computed.num_tokens == 0
    assert kv.pool.num_cached_blocks == 0
    assert kv.prefix_cache_queried_tokens == 0 and kv.prefix_cache_hit_tokens == 0
    run_prefill(kv, "B", A_TOKENS)
    assert kv.block_table("B") == [3, 4, 5]  # plain LRU reuse from the queue head


def test_free_is_idempotent_and_reset_prefix_cache() -> None:
    kv = manager()
    kv.free("nobody")
    run_prefill(kv, "A", A_TOKENS)
    assert kv.reset_prefix_cache() is False  # A still holds cached blocks
    kv.free("A")
    kv.free("A")
    kv.check_invariants()
    assert kv.reset_prefix_cache() is True
    kv.check_invariants()
    assert kv.get_computed_blocks(A_TOKENS).num_tokens == 0


def test_misuse_raises() -> None:
    kv = manager()
    run_prefill(kv, "A", A_TOKENS)
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots("A", 12, ComputedBlocks())
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError):
        KVCacheManager(0, 4)


def test_stale_hit_is_rejected() -> None:
    kv = manager(num_blocks=3)
    run_prefill(kv, "A", A_TOKENS)
    kv.free("A")
    computed = kv.get_computed_blocks(A_TOKENS)
    assert kv.allocate_slots("C", 12)  # evicts the hit blocks behind the lookup's back
    kv.free("C")
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots("B", 10, computed)
    kv.check_invariants()


def test_salted_requests_share_blocks_only_with_their_own_salt() -> None:
    """Tenant isolation: a request hits only blocks cached under its own cache_salt; the
    unsalted chain ("") is a salt of its own; requests with the same salt still share."""
    kv = manager(num_blocks=12)
    tokens = A_TOKENS[:8] + [7, 7]
    computed = kv.get_computed_blocks(tokens, "tenant-a")
    assert computed.num_tokens == 0
    assert kv.allocate_slots("A", len(tokens), computed)
    kv.cache_full_blocks("A", tokens, len(tokens), "tenant-a")
    kv.check_invariants()
    salted_root = chain_root("tenant-a")
    assert salted_root is not None and chain_root("") is None
    h0 = hash_block(salted_root, tokens[0:4])
    assert kv.pool.blocks[0].block_hash == h0 != hash_block(None, tokens[0:4])

    assert kv.get_computed_blocks(tokens, "tenant-b").num_tokens == 0
    assert kv.get_computed_blocks(tokens).num_tokens == 0
    same = kv.get_computed_blocks(tokens, "tenant-a")
    assert [b.block_id for b in same.blocks] == [0, 1] and same.num_tokens == 8
    assert kv.allocate_slots("A2", len(tokens), same)
    kv.check_invariants()
    assert refs(kv, [0, 1]) == [2, 2]
    # The other tenant computes its own copy; its blocks are cached under its own salt.
    other = kv.get_computed_blocks(tokens, "tenant-b")
    assert kv.allocate_slots("B", len(tokens), other)
    kv.cache_full_blocks("B", tokens, len(tokens), "tenant-b")
    kv.check_invariants()
    assert kv.block_table("B") == [4, 5, 6] and refs(kv, [0, 1, 4, 5]) == [2, 2, 1, 1]
    assert kv.get_computed_blocks(tokens, "tenant-b").num_tokens == 8


# --------------------------------------------------------------------------- sliding window
# Window W = 8, blocks of 4: a chunk starting at s frees blocks i < (s - 7) // 4 (those wholly
# before position s - W + 1); block 0 is the null block that takes their place in the table.

LONG_TOKENS = list(range(100, 140))


def chain_hash(tokens: list[int], num_blocks: int) -> int | None:
    """The chained hash of the first num_blocks blocks of 4."""
    parent = None
    for i in range(num_blocks):
        parent = hash_block(parent, tokens[4 * i : 4 * i + 4])
    return parent


def windowed(num_blocks: int, caching: bool = True) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching, sliding_window=8)
    kv.check_invariants()
    return kv


def advance(kv: KVCacheManager, request_id: str, start: int, end: int, tokens=LONG_TOKENS):
    """Schedule positions [start, end) of a running request, then mark them computed."""
    assert kv.allocate_slots(request_id, end, num_computed_tokens=start)
    kv.check_invariants()
    kv.cache_full_blocks(request_id, tokens, end)
    kv.check_invariants()


def test_window_frees_dead_blocks_and_bounds_the_table() -> None:
    kv = windowed(num_blocks=6)  # null block 0 + 5 usable
    assert kv.null_block_id == 0 and kv.num_usable_blocks == 5 and kv.num_free_blocks == 5
    for start in (0, 4, 8):  # chunks of 4: nothing is dead before position 8 - 7 = 1
        advance(kv, "A", start, start + 4)
    assert kv.block_table("A") == [1, 2, 3] and free_order(kv) == [4, 5]
    advance(kv, "A", 12, 16)  # block 0 (positions 0..3) lies before 12 - 7 = 5: freed first
    assert kv.block_table("A") == [0, 2, 3, 4] and free_order(kv) == [5, 1]
    assert kv.pool.blocks[1].block_hash == hash_block(None, LONG_TOKENS[0:4])  # still cached
    assert kv.num_window_freed_blocks == 1
    advance(kv, "A", 16, 17)  # decode at 16 sees 9..16: block 1 (4..7) is dead
    assert kv.block_table("A") == [0, 0, 3, 4, 5] and free_order(kv) == [1, 2]
    live = {16: 3}
    for start in range(17, 30):
        advance(kv, "A", start, start + 1)
        live[start] = sum(1 for block_id in kv.block_table("A") if block_id != 0)
    # A decode's 8 visible positions straddle at most 3 blocks, however long the request.
    assert max(live.values()) == 3
    assert kv.block_table("A") == [0, 0, 0, 0, 0, 1, 2, 3]  # positions 20..29 in 1, 2, 3
    assert free_order(kv) == [4, 5] and kv.num_window_freed_blocks == 5
    # Block 1 was reused for positions 20..23: evicted, then cached under its new place in
    # the chain (which goes on through the hashes of the freed blocks).
    assert kv.pool.blocks[1].block_hash == chain_hash(LONG_TOKENS, 6)
    kv.free("A")  # only the live blocks come back; the null block stays reserved
    kv.check_invariants()
    assert free_order(kv) == [4, 5, 3, 2, 1] and kv.num_free_blocks == 5


def test_window_freeing_stands_when_growth_fails() -> None:
    kv = windowed(num_blocks=4)  # 3 usable
    advance(kv, "A", 0, 8)
    advance(kv, "B", 0, 4)
    assert kv.block_table("A") == [1, 2] and kv.block_table("B") == [3]
    # A's chunk at 12 frees block 1 (positions 0..3) but needs 2 more blocks: only 1 free.
    assert not kv.allocate_slots("A", 16, num_computed_tokens=12)
    kv.check_invariants()
    assert kv.block_table("A") == [0, 2] and free_order(kv) == [1]
    assert kv.allocate_slots("A", 12, num_computed_tokens=12)
    kv.check_invariants()
    assert kv.block_table("A") == [0, 2, 1]


def test_window_with_prefix_sharing() -> None:
    kv = windowed(num_blocks=10)
    a_tokens = LONG_TOKENS[:20]
    assert kv.allocate_slots("A", 8, kv.get_computed_blocks(a_tokens))
    kv.cache_full_blocks("A", a_tokens, 8)
    advance(kv, "A", 8, 16, a_tokens)
    advance(kv, "A", 16, 20, a_tokens)  # frees blocks 2 then 1 (positions 0..7)
    assert kv.block_table("A") == [0, 0, 3, 4, 5]
    assert free_order(kv) == [6, 7, 8, 9, 2, 1]
    assert refs(kv, [1, 2, 3, 4, 5]) == [0, 0, 1, 1, 1]

    # B shares A's first 16 tokens: the hit is blocks [1, 2, 3, 4], but B's first chunk at
    # 16 never sees blocks 1 and 2, so they are not taken (they stay free and cached).
    b_tokens = a_tokens[:16] + [7, 7, 7, 7]
    computed = kv.get_computed_blocks(b_tokens)
    assert [b.block_id for b in computed.blocks] == [1, 2, 3, 4] and computed.num_tokens == 16
    assert kv.allocate_slots("B", 20, computed)
    kv.check_invariants()
    assert kv.block_table("B") == [0, 0, 3, 4, 6]
    assert refs(kv, [1, 2, 3, 4, 5, 6]) == [0, 0, 2, 2, 1, 1]
    assert free_order(kv) == [7, 8, 9, 2, 1]

    # A's next decode frees block 3 from A only: B still holds it.
    advance(kv, "A", 20, 21, a_tokens + [5])
    assert kv.block_table("A") == [0, 0, 0, 4, 5, 7]
    assert refs(kv, [3, 4]) == [1, 2]
    kv.free("A")
    kv.free("B")
    kv.check_invariants()
    assert kv.num_free_blocks == 9


def test_hit_on_blocks_freed_then_evicted_ends_there() -> None:
    kv = windowed(num_blocks=6)
    for start in (0, 4, 8, 12):
        advance(kv, "A", start, start + 4)
    advance(kv, "A", 16, 17)  # block 1 was freed by the chunk at 12, block 2 by this one
    assert kv.block_table("A") == [0, 0, 3, 4, 5] and free_order(kv) == [1, 2]
    assert kv.allocate_slots("C", 4)  # takes block 1 (A's positions 0..3): its hash goes
    kv.check_invariants()
    assert kv.block_table("C") == [1] and kv.pool.blocks[1].block_hash is None
    assert kv.get_computed_blocks(LONG_TOKENS[:17]).blocks == []  # the chain's first is gone
    kv.free("C")
    kv.check_invariants()
    assert kv.allocate_slots("D", 4)  # now block 2 (A's 4..7) is the queue head: evicted
    computed = kv.get_computed_blocks(LONG_TOKENS[:17])
    assert computed.blocks == []


def test_window_hit_evicted_in_the_middle_stops_the_chain() -> None:
    kv = windowed(num_blocks=8)
    for start in (0, 4, 8, 12):
        advance(kv, "A", start, start + 4)
    advance(kv, "A", 16, 17)
    assert kv.block_table("A") == [0, 0, 3, 4, 5] and free_order(kv) == [6, 7, 1, 2]
    # B hits A's freed first block (its chunk at 4 still sees it): block 1 is revived.
    b_tokens = LONG_TOKENS[:4] + [9]
    computed = kv.get_computed_blocks(b_tokens)
    assert [b.block_id for b in computed.blocks] == [1]
    assert kv.allocate_slots("B", 5, computed)
    kv.check_invariants()
    assert kv.block_table("B") == [1, 6] and free_order(kv) == [7, 2]
    assert kv.allocate_slots("C", 4)  # takes 7, then D takes 2 (A's positions 4..7)
    assert kv.allocate_slots("D", 4)
    kv.check_invariants()
    assert kv.block_table("D") == [2] and kv.num_free_blocks == 0
    kv.free("B")
    kv.check_invariants()
    computed = kv.get_computed_blocks(LONG_TOKENS[:17])
    assert [b.block_id for b in computed.blocks] == [1] and computed.num_tokens == 4


def test_window_misuse() -> None:
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(4, 4, sliding_window=0)
    kv = manager()
    assert kv.null_block_id is None and kv.sliding_window is None
    assert kv.num_usable_blocks == kv.num_blocks == 8
