"""BlockPool: every KV-cache block, its reference count, the LRU free queue and the prefix map."""

from __future__ import annotations

from collections.abc import Iterable

from kvcache.block import KVCacheBlock
from kvcache.free_queue import FreeBlockQueue


class BlockPoolError(RuntimeError):
    """A block was used against the pool's rules (double free, over-allocation)."""


class BlockPool:
    """Owns blocks 0..num_blocks-1. Invariants (check_invariants() verifies them):

    - free + used + reserved = total, where used blocks have ref_count > 0;
    - ref_count >= 0, and ref_count == 0 <=> the block is in the free queue (exactly once),
      except the null block;
    - the hash map and block.block_hash agree: map[h] is b <=> b.block_hash == h;
    - the null block (reserve_null_block: block 0) is reserved: ref_count 0, never in the free
      queue, never cached, never handed out, touched or freed. Block tables put it where a
      sliding window freed a block; the engine never writes its slots, so they stay zero.

    A freed block keeps its hash while it waits in the free queue, so a later request with the
    same prefix can revive it (touch). It is evicted lazily: its hash is dropped only when
    get_new_blocks hands it out for new tokens.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False
    ) -> None:
        num_reserved = 1 if reserve_null_block else 0
        if num_blocks < 1 + num_reserved:
            raise ValueError(f"num_blocks must be >= {1 + num_reserved}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_blocks - num_reserved  # all but the null block
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if reserve_null_block else None
        self.free_queue = FreeBlockQueue(self.blocks[num_reserved:])
        self._cached: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds, cached ones included (they are evictable)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by at least one request, 0..1."""
        return (self.num_usable_blocks - len(self.free_queue)) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the free-queue head (least recently freed first), ref_count 1."""
        if n > len(self.free_queue):
            raise BlockPoolError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference (a prefix hit); a free cached block leaves the free queue."""
        for block in blocks:
            if block is self.null_block:
                raise BlockPoolError("the null block is never touched")
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free-queue tail in the given
        order, so the first given is evicted first."""
        for block in blocks_in_eviction_order:
            if block is self.null_block:
                raise BlockPoolError("the null block is never freed")
            if block.ref_count <= 0:
                raise BlockPoolError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Register a full, computed block under its chained hash.

        If another block already holds this hash (two requests computed the same prefix at the
        same time), the first one stays the cached copy and this block stays uncached.
        """
        if not self.enable_caching:
            return
        if block.ref_count <= 0:
            raise BlockPoolError(f"caching free block {block.block_id}")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise BlockPoolError(f"block {block.block_id} already cached under another hash")
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, so running
        requests never lose blocks they share through the cache."""
        if len(self.free_queue) != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        free_ids = self.free_queue.block_ids()
        free_set = set(free_ids)
        _require(len(free_set) == len(free_ids), f"a block is twice in the free queue: {free_ids}")
        _require(len(free_ids) == len(self.free_queue), "free queue length disagrees with links")
        null = self.null_block
        if null is not None:
            _require(
                null.ref_count == 0 and null.block_id not in free_set,
                f"null block {null.block_id}: ref_count {null.ref_count}, or in the free queue",
            )
            _require(null.block_hash is None, "the null block is cached")
        used = 0
        for block in self.blocks:
            _require(block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}")
            if block is null:
                continue
            in_queue = block.block_id in free_set
            _require(
                (block.ref_count == 0) == in_queue,
                f"block {block.block_id}: ref_count {block.ref_count}, in free queue {in_queue}",
            )
            used += block.ref_count > 0
            if block.block_hash is not None:
                _require(
                    self._cached.get(block.block_hash) is block,
                    f"block {block.block_id} has a hash the map does not point back from",
                )
        reserved = self.num_blocks - self.num_usable_blocks
        _require(used + len(free_ids) + reserved == self.num_blocks, "free + used != total")
        for block_hash, block in self._cached.items():
            _require(block.block_hash == block_hash, f"map entry for block {block.block_id} stale")
        _require(self.enable_caching or not self._cached, "caching disabled but blocks cached")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"BlockPool invariant broken: {message}")
