"""How far the head of the waiting queue is admitted this step (scheduler rules 6-8): its
prefix-cache hit, its first chunk cut to the budget left, its blocks; or why it waits, or why
it can never run."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.kv_cache_manager import ComputedBlocks, KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.fit_errors import budget_error, unfittable_error
from scheduler.request import Request


@dataclass(frozen=True, slots=True)
class Admission:
    """The head request's first chunk of num_new tokens after its hit `computed`, its blocks
    allocated; or, when `error` is set, why it can never run (it fails, FINISHED_ERROR)."""

    computed: ComputedBlocks
    num_new: int
    error: str | None = None


def admit_head(
    request: Request,
    budget: int,
    config: SchedulerConfig,
    kv_cache: KVCacheManager,
    num_running: int,
) -> Admission | None:
    """The admission of `request`, the head of the waiting queue, with `budget` tokens left
    and `num_running` requests running; None while it waits (and, rule 6, all behind it)."""
    chunked = config.enable_chunked_prefill
    computed = computed_blocks(request, kv_cache)
    num_new = request.num_tokens - computed.num_tokens
    if num_new > budget and not chunked:
        if num_new <= config.max_num_batched_tokens:
            return None  # fits a later, emptier step (rule 6: nobody overtakes it)
        return Admission(computed, num_new, budget_error(num_new, config.max_num_batched_tokens))
    if chunked:  # unchunked, the branch above left only a whole rest that fits
        num_new = min(num_new, budget, config.max_chunk_tokens)
    total = computed.num_tokens + num_new
    if not kv_cache.allocate_slots(request.request_id, total, computed):
        if num_running:
            return None  # blocks come back as running requests finish
        # nobody holds blocks, yet it never fits
        error = unfittable_error(kv_cache, request, computed.num_tokens, total)
        return Admission(computed, num_new, error)
    return Admission(computed, num_new)


def computed_blocks(request: Request, kv_cache: KVCacheManager) -> ComputedBlocks:
    """The request's prefix-cache hit under its cache_salt."""
    if request.sampling_params.prompt_logprobs is not None:
        return ComputedBlocks()  # rule 6: every prompt position needs its logits
    return kv_cache.get_computed_blocks(request.token_ids, request.cache_salt)
