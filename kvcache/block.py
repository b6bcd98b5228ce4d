"""KVCacheBlock: one fixed-size block of KV-cache slots, as the bookkeeping sees it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block: slots block_id * block_size .. block_id * block_size + block_size - 1.

    ref_count is the number of block tables holding the block; a block with ref_count 0 sits in
    the free queue (possibly still cached: block_hash set, reusable by a prefix hit until it is
    evicted). prev_free / next_free link it into the FreeBlockQueue and are None outside it.
    Compared by identity (eq=False): two blocks are the same block only if they are one object.
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)
