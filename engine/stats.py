"""StepStats: what one engine step did and cost; the meter's raw material."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheInfo:
    """Facts about the KV cache discovered at start-up (returned, never written into config)."""

    block_size: int
    num_blocks: int  # allocated, the reserved ones included
    bytes_per_block: int
    num_reserved_blocks: int = 0  # the sliding window's null block: never holds tokens

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (all free once the engine is idle)."""
        return self.num_blocks - self.num_reserved_blocks

    @property
    def max_tokens(self) -> int:
        """Tokens the usable blocks hold, all requests together."""
        return self.num_usable_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step: timing (time.monotonic seconds), contents, and the cost model's estimates.

    duration_s is split into prefill_seconds + decode_seconds by roofline share
    (engine/meter/attribution.py).
    """

    started_at: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_chunks: int
    num_decode_requests: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks in use / total
    num_preemptions: int  # preemptions that happened in this step's schedule()
    prefix_cache_queried_tokens: int  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hit_tokens: int  # of which found cached
    prefill_flops: float
    decode_flops: float
    prefill_bytes: float
    decode_bytes: float
    prefill_seconds: float
    decode_seconds: float
    num_forward_passes: int  # 1, or more when a fault forced per-request re-execution
    num_window_freed_blocks: int = 0  # block references a sliding window freed this step
    # Speculative decoding: draft tokens verified, decodes that carried drafts, drafts kept.
    num_draft_tokens: int = 0
    num_drafting_requests: int = 0
    num_accepted_draft_tokens: int = 0
    num_draft_backoffs: int = 0  # decodes whose drafts were all rejected: drafting paused
    # A draft model's passes this step (speculative method "draft_model") and their seconds
    # (part of duration_s).
    num_draft_model_passes: int = 0
    draft_model_seconds: float = 0.0
