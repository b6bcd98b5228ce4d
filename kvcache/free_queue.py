"""FreeBlockQueue: the LRU order of free blocks, a doubly linked list with O(1) operations."""

from __future__ import annotations

from collections.abc import Iterable

from kvcache.block import KVCacheBlock


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first, freed blocks join at
    the tail. remove() takes a block out of the middle in O(1) when a prefix hit revives a
    freed-but-cached block.

    Two sentinel blocks (id -1) bracket the list, so a block is in the queue exactly when its
    links are set, and no operation needs an empty-list special case.
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self._unlink(first)
        return first

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None  # the tail sentinel always has a predecessor
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Take a block out of the middle (a prefix hit on a free cached block)."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def block_ids(self) -> list[int]:
        """Block ids from head (evicted first) to tail; O(n), for tests and invariant checks."""
        ids: list[int] = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
            if len(ids) > self._len:
                raise AssertionError("free queue links form a cycle or disagree with its length")
        return ids

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = None
        block.next_free = None
        self._len -= 1
