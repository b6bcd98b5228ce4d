"""KVCacheManager: per-request block tables over one BlockPool, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block import KVCacheBlock
from kvcache.block_pool import BlockPool
from kvcache.prefix_hash import chain_root, hash_block


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
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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
        self, request_id: str, num_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Grow the request's table to cover num_tokens tokens in total.

        `computed` (first call only) puts the hit blocks first in the table. Returns False and
        changes nothing when the pool cannot supply the blocks; free cached blocks count as free.
        """
        table = self._tables.get(request_id)
        hit = computed.blocks if computed is not None else []
        if table is not None and computed is not None:
            raise ValueError(
                f"request {request_id!r} already has blocks; computed is for admission"
            )
        if computed is not None and num_tokens < computed.num_tokens:
            raise ValueError("num_tokens must cover the prefix-cache hit")
        num_held = len(table) if table is not None else len(hit)
        num_new = -(-num_tokens // self.block_size) - num_held
        if table is not None and num_new <= 0:
            return True  # fast path: a decode inside its last block
        # A hit block with ref_count 0 sits in the free queue: touching it takes it out.
        num_revived = sum(1 for block in hit if block.ref_count == 0)
        if max(num_new, 0) > self.pool.num_free_blocks - num_revived:
            return False
        if table is None:
            table = self._admit(request_id, computed)
        if num_new > 0:
            new_blocks = self.pool.get_new_blocks(num_new)
            table.extend(new_blocks)
            self._table_ids[request_id].extend(block.block_id for block in new_blocks)
        return True

    def _admit(self, request_id: str, computed: ComputedBlocks | None) -> list[KVCacheBlock]:
        hit = computed.blocks if computed is not None else []
        hashes: list[int] = []
        for block in hit:
            if block.block_hash is None:
                raise ValueError("stale ComputedBlocks: a hit block was evicted since the lookup")
            hashes.append(block.block_hash)
        self.pool.touch(hit)
        table = list(hit)
        self._tables[request_id] = table
        self._table_ids[request_id] = [block.block_id for block in hit]
        self._block_hashes[request_id] = hashes
        if computed is not None:
            self.prefix_cache_queried_tokens += computed.num_queried_tokens
            self.prefix_cache_hit_tokens += computed.num_tokens
        return table

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
            self.pool.cache_full_block(table[i], block_hash)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first: the end of a sequence is the least likely
        to be shared, so it is evicted first and a shared prefix last. Unknown ids are ignored."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        del self._table_ids[request_id]
        del self._block_hashes[request_id]
        self.pool.free_blocks(reversed(table))

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids (empty for an unknown request)."""
        ids = self._table_ids.get(request_id)
        return list(ids) if ids is not None else []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """The pool's invariants, plus: each block's ref_count equals the number of tables
        holding it, and each table's id list and hashes agree with its blocks."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for request_id, table in self._tables.items():
            ids = [block.block_id for block in table]
            _require(ids == self._table_ids[request_id], f"{request_id}: id list out of step")
            _require(len(set(ids)) == len(ids), f"{request_id}: a block twice in one table")
            _require(len(self._block_hashes[request_id]) <= len(table), f"{request_id}: hashes")
            for block in table:
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
