"""FreeBlockQueue: exact order after every O(1) operation."""

from __future__ import annotations

import pytest

from kvcache.block import KVCacheBlock
from kvcache.free_queue import FreeBlockQueue


def make_queue(n: int) -> tuple[FreeBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def test_starts_in_given_order() -> None:
    queue, _ = make_queue(4)
    assert queue.block_ids() == [0, 1, 2, 3]
    assert len(queue) == 4


def test_popleft_append_remove_keep_order() -> None:
    queue, blocks = make_queue(5)
    assert queue.popleft() is blocks[0]
    assert queue.block_ids() == [1, 2, 3, 4]
    queue.remove(blocks[2])  # from the middle
    assert queue.block_ids() == [1, 3, 4]
    queue.remove(blocks[1])  # the head
    queue.remove(blocks[4])  # the tail
    assert queue.block_ids() == [3]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert queue.block_ids() == [3, 0, 2]
    assert len(queue) == 3
    assert blocks[0] in queue and blocks[1] not in queue


def test_empty_queue_pop_raises_and_refills() -> None:
    queue, blocks = make_queue(2)
    queue.popleft()
    queue.popleft()
    assert len(queue) == 0 and queue.block_ids() == []
    with pytest.raises(IndexError):
        queue.popleft()
    queue.append(blocks[1])
    assert queue.block_ids() == [1]
    assert queue.popleft() is blocks[1]


def test_misuse_raises() -> None:
    queue, blocks = make_queue(3)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])
    queue.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    assert queue.block_ids() == [0, 2]


def test_links_are_cleared_outside_the_queue() -> None:
    queue, blocks = make_queue(3)
    block = queue.popleft()
    assert block.prev_free is None and block.next_free is None
    queue.remove(blocks[1])
    assert blocks[1].prev_free is None and blocks[1].next_free is None
