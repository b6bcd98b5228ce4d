"""KVCacheManager: per-request block tables over one BlockPool, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block import KVCacheBlock
from kvcache.block_pool import BlockPool
from kvcache.prefix_hash import chain_root, hash_block
from kvcache.window import num_dead_blocks


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix-cache hit: `blocks` already hold the KV of the first `num_tokens` tokens.

    num_queried_tokens is how many tokens the lookup covered; the hit/query counters advance
    when the hit is used by allocate_slots, so a request that waits through many steps is
    counted once per admission, not once per lookup.
    """

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0
    num_queried_tokens: int = 0


class KVCacheManager:
    """Maps request ids to block tables and keeps the prefix cache filled.

    A request's table covers token positions 0 .. len(table) * block_size - 1: token i lives in
    block table[i // block_size] at offset i % block_size (slot = block_id * block_size + offset).
    The only holders of block references are these tables: a block's ref_count equals the number
    of tables containing it (check_invariants verifies it).

    With a sliding window of W tokens (every layer of the model attends through it) the pool
    reserves block 0 as the null block, and allocate_slots frees a running request's dead
    blocks (kvcache/window.py) before its next chunk: their table entries become the null
    block, always a prefix of the table, table[:num_dead]. A freed block keeps its hash, so it
    stays in the prefix cache as evictable, like a finished request's blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.pool = BlockPool(num_blocks, enable_prefix_caching, sliding_window is not None)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._sliding_window = sliding_window
        # Leading table entries freed by the window (now the null block), per request.
        self._num_dead: dict[str, int] = {}
        self.num_window_freed_blocks = 0  # block references dropped by the window, ever
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # Block ids of each table, kept in step with _tables so block_table() is one list copy.
        self._table_ids: dict[str, list[int]] = {}
        # Chained hashes of each request's registered (full, computed) blocks, in table order.
        self._block_hashes: dict[str, list[int]] = {}
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.pool.num_usable_blocks

    @property
    def sliding_window(self) -> int | None:
        """The window every layer attends through, or None (nothing is freed early)."""
        return self._sliding_window

    @property
    def null_block_id(self) -> int | None:
        """The block id tables hold in place of freed blocks (None without a window)."""
        null = self.pool.null_block
        return None if null is None else null.block_id

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, token_ids: Sequence[int], cache_salt: str = "") -> ComputedBlocks:
        """Longest cached prefix of full blocks under `cache_salt` (only blocks cached by a
        request with the same salt match). Never covers the last token, so at least one
        token is left to compute and sample from. Use the result before any other allocation."""
        if not self.enable_prefix_caching:
            return ComputedBlocks()
        size = self.block_size
        max_blocks = (len(token_ids) - 1) // size
        blocks: list[KVCacheBlock] = []
        parent = chain_root(cache_salt)
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * size : (i + 1) * size])
            block = self.pool.get_cached_block(parent)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(blocks, len(blocks) * size, len(token_ids))

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        computed: ComputedBlocks | None = None,
        num_computed_tokens: int = 0,
    ) -> bool:
        """Grow the request's table to cover num_tokens tokens in total.

        `computed` (first call only) puts the hit blocks first in the table. With a sliding
        window, the blocks dead for the chunk starting at num_computed_tokens (on admission:
        at the hit's end) are freed first, and hit blocks already dead are never taken; that
        freeing stands even when the growth fails (those blocks are dead either way).
        Returns False and changes nothing else when the pool cannot supply the blocks; free
        cached blocks count as free.
        """
        table = self._tables.get(request_id)
        if table is None:
            return self._admit(request_id, num_tokens, computed)
        if computed is not None:
            raise ValueError(
                f"request {request_id!r} already has blocks; computed is for admission"
            )
        self._free_dead_blocks(request_id, num_computed_tokens)
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new <= 0:
            return True  # fast path: a decode inside its last block
        if num_new > self.pool.num_free_blocks:
            return False
        self._extend(request_id, num_new)
        return True

    def _admit(self, request_id: str, num_tokens: int, computed: ComputedBlocks | None) -> bool:
        hit = computed.blocks if computed is not None else []
        num_hit_tokens = computed.num_tokens if computed is not None else 0
        if num_tokens < num_hit_tokens:
            raise ValueError("num_tokens must cover the prefix-cache hit")
        hashes: list[int] = []
        for block in hit:
            if block.block_hash is None:
                raise ValueError("stale ComputedBlocks: a hit block was evicted since the lookup")
            hashes.append(block.block_hash)
        # hit[:num_dead] lie before the first chunk's window: hashed (the chain goes on from
        # them) but never held.
        num_dead = min(
            num_dead_blocks(num_hit_tokens, self._sliding_window, self.block_size), len(hit)
        )
        live = hit[num_dead:]
        num_new = -(-num_tokens // self.block_size) - len(hit)
        # A hit block with ref_count 0 sits in the free queue: touching it takes it out.
        num_revived = sum(1 for block in live if block.ref_count == 0)
        if max(num_new, 0) > self.pool.num_free_blocks - num_revived:
            return False
        self.pool.touch(live)
        table = [self._null_block()] * num_dead + live if num_dead else list(live)
        self._tables[request_id] = table
        self._table_ids[request_id] = [block.block_id for block in table]
        self._block_hashes[request_id] = hashes
        self._num_dead[request_id] = num_dead
        if computed is not None:
            self.prefix_cache_queried_tokens += computed.num_queried_tokens
            self.prefix_cache_hit_tokens += computed.num_tokens
        if num_new > 0:
            self._extend(request_id, num_new)
        return True

    def _extend(self, request_id: str, num_new: int) -> None:
        new_blocks = self.pool.get_new_blocks(num_new)
        self._tables[request_id].extend(new_blocks)
        self._table_ids[request_id].extend(block.block_id for block in new_blocks)

    def _free_dead_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free table[num_dead:target], the blocks no query at or after num_computed_tokens
        sees, and put the null block in their place (latest first in the eviction order: a
        later block of a chain is useless for a prefix hit once an earlier one is gone)."""
        table = self._tables[request_id]
        target = min(
            num_dead_blocks(num_computed_tokens, self._sliding_window, self.block_size),
            len(table),
        )
        done = self._num_dead[request_id]
        if target <= done:
            return
        dead = table[done:target]
        null = self._null_block()
        table[done:target] = [null] * (target - done)
        self._table_ids[request_id][done:target] = [null.block_id] * (target - done)
        self._num_dead[request_id] = target
        self.pool.free_blocks(reversed(dead))
        self.num_window_freed_blocks += len(dead)

    def _null_block(self) -> KVCacheBlock:
        null = self.pool.null_block
        assert null is not None, "blocks are freed early only under a sliding window"
        return null

    def cache_full_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str = "",
    ) -> None:
        """Register blocks that became full and computed, under the request's `cache_salt`
        (the same salt its lookup used). Incremental: hashes chain from the request's last
        registered block, so each block is hashed once."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        hashes = self._block_hashes[request_id]
        size = self.block_size
        num_full = min(num_computed_tokens // size, len(table))
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i > 0 else chain_root(cache_salt)
            block_hash = hash_block(parent, token_ids[i * size : (i + 1) * size])
            hashes.append(block_hash)
            if i >= self._num_dead[request_id]:  # a freed block's hash only extends the chain
                self.pool.cache_full_block(table[i], block_hash)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first: the end of a sequence is the least likely
        to be shared, so it is evicted first and a shared prefix last. Unknown ids are ignored."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        del self._table_ids[request_id]
        del self._block_hashes[request_id]
        num_dead = self._num_dead.pop(request_id)
        self.pool.free_blocks(reversed(table[num_dead:]))

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids (empty for an unknown request)."""
        ids = self._table_ids.get(request_id)
        return list(ids) if ids is not None else []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """The pool's invariants, plus: each block's ref_count equals the number of tables
        holding it, each table's id list and hashes agree with its blocks, and the null block
        fills exactly the table's first num_dead entries."""
        self.pool.check_invariants()
        _require(self._num_dead.keys() == self._tables.keys(), "num_dead out of step")
        null = self.pool.null_block
        holders = [0] * self.pool.num_blocks
        for request_id, table in self._tables.items():
            ids = [block.block_id for block in table]
            _require(ids == self._table_ids[request_id], f"{request_id}: id list out of step")
            num_dead = self._num_dead[request_id]
            _require(
                all(block is null for block in table[:num_dead])
                and all(block is not null for block in table[num_dead:]),
                f"{request_id}: the null block is not exactly table[:{num_dead}]",
            )
            live = ids[num_dead:]
            _require(len(set(live)) == len(live), f"{request_id}: a block twice in one table")
            _require(len(self._block_hashes[request_id]) <= len(table), f"{request_id}: hashes")
            for block in table[num_dead:]:
                holders[block.block_id] += 1
        for block in self.pool.blocks:
            _require(
                holders[block.block_id] == block.ref_count,
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {holders[block.block_id]} tables",
            )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"KVCacheManager invariant broken: {message}")
