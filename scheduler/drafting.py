"""Which draft tokens a decode carries (scheduler rule 10): proposed within their limits, their
KV slots allocated, and the backoff a decode whose drafts were all rejected begins.

With a draft model the scheduler proposes no tokens itself: it reserves DRAFT_SLOT
placeholders, budgeted and allocated like n-gram drafts, which the engine's draft model fills
before the pass (engine/draft_model.py)."""

from __future__ import annotations

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.ngram_proposer import propose_ngram_drafts
from scheduler.output import RunnerOutput, ScheduledChunk
from scheduler.request import Request
from scheduler.speculative_config import SpeculativeConfig

DRAFT_SLOT = -1  # a draft position the draft model fills before the runner sees the chunk


def scheduled_drafts(
    request: Request, num_new: int, room: int, config: SchedulerConfig, kv_cache: KVCacheManager
) -> list[int]:
    """A decode's draft tokens, their KV slots allocated; [] for none (drafts never preempt)."""
    spec = config.speculative
    if spec is None or num_new != 1:
        return []
    drafts = propose_drafts(request, spec, room, config.max_model_len)
    start = request.num_computed_tokens
    total = start + num_new + len(drafts)
    if drafts and not kv_cache.allocate_slots(request.request_id, total, num_computed_tokens=start):
        return []
    return drafts


def propose_drafts(
    request: Request, spec: SpeculativeConfig, room: int, max_model_len: int
) -> list[int]:
    """At most `room` drafts for the request's next decode (n-gram tokens, or slots for the
    draft model), none past max_tokens (the token sampled after them comes last) or the
    context; none while its backoff lasts."""
    if request.draft_backoff.skips():
        return []
    limit = min(
        spec.num_speculative_tokens,
        room,
        request.sampling_params.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens,  # the last draft's position fits the context
    )
    if limit < 1:
        return []
    if spec.method == "draft_model":
        return [DRAFT_SLOT] * limit
    return propose_ngram_drafts(
        request.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, limit
    )


def record_drafts(
    request: Request,
    chunk: ScheduledChunk,
    runner_output: RunnerOutput,
    spec: SpeculativeConfig | None,
) -> bool:
    """After a sampled chunk: True when its drafts were all rejected and a backoff began."""
    if spec is None or not chunk.draft_token_ids:
        return False
    accepted = len(runner_output.accepted_draft_token_ids.get(request.request_id, ()))
    return request.draft_backoff.record(chunk.num_draft_tokens, accepted, spec.max_backoff_steps)
