"""Sliding-window block arithmetic: which of a request's blocks its next chunk can still see.

With a window of W tokens the query at position p sees keys j with p - W < j <= p. A chunk
starting at position s has queries at s and later, so neither it nor any later chunk of the
request reads a key before position s - W + 1. Blocks wholly before that position are dead:

    block i covers positions [i * block_size, (i + 1) * block_size - 1]
    dead for a chunk at s  <=>  (i + 1) * block_size - 1 < s - W + 1
                           <=>  i < (s - W + 1) // block_size

While it computes positions [s, s + C) a request therefore holds the blocks covering
positions max(0, s - W + 1) .. s + C - 1: at most W + C - 1 positions, which straddle at most
ceil((W + C - 1 + block_size - 1) / block_size) blocks (the first one may start mid-block).
"""

from __future__ import annotations


def num_dead_blocks(start: int, window: int | None, block_size: int) -> int:
    """Leading blocks no query at position >= start sees (0 without a window)."""
    if window is None:
        return 0
    return max(0, (start - window + 1) // block_size)


def num_live_blocks(start: int, end: int, window: int | None, block_size: int) -> int:
    """Blocks a request holds while computing positions [start, end): its table covers
    positions 0 .. end - 1, less the dead blocks."""
    return -(-end // block_size) - num_dead_blocks(start, window, block_size)


def max_live_blocks(window: int, max_chunk_tokens: int, block_size: int) -> int:
    """The most blocks one request holds at once when no chunk exceeds max_chunk_tokens,
    however long the request (the bound in the module docstring)."""
    span = window + max_chunk_tokens - 1
    return -(-(span + block_size - 1) // block_size)
