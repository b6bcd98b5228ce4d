"""Why a request can never run (scheduler rule 8): the messages of its FINISHED_ERROR."""

from __future__ import annotations

from kvcache.kv_cache_manager import KVCacheManager
from kvcache.window import num_live_blocks
from scheduler.request import Request


def unfittable_error(kv: KVCacheManager, request: Request, start: int, end: int) -> str:
    """Why positions [start, end) of a request that alone holds blocks do not fit."""
    capacity = f"{kv.num_usable_blocks} blocks of {kv.block_size} tokens"
    if kv.sliding_window is None:
        return (
            f"request needs {request.num_tokens} tokens of KV cache but the cache holds "
            f"only {capacity} ({kv.num_usable_blocks * kv.block_size})"
        )
    need = num_live_blocks(start, end, kv.sliding_window, kv.block_size)
    return (
        f"request needs {need} KV blocks at once for positions {start}..{end - 1} "
        f"(sliding window of {kv.sliding_window} tokens) but the cache holds only {capacity}"
    )


def budget_error(num_new: int, max_num_batched_tokens: int) -> str:
    return (
        f"request needs {num_new} tokens in one step but max_num_batched_tokens is "
        f"{max_num_batched_tokens} and chunked prefill is disabled"
    )
