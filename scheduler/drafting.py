"""Which draft tokens a decode carries (scheduler rule 10), before their KV blocks are asked for."""

from __future__ import annotations

from scheduler.ngram_proposer import propose_ngram_drafts
from scheduler.request import Request
from scheduler.speculative_config import SpeculativeConfig


def propose_drafts(
    request: Request, spec: SpeculativeConfig, room: int, max_model_len: int
) -> list[int]:
    """At most `room` n-gram drafts for the request's next decode, none past max_tokens (the
    token sampled after them comes last) or the context; none while its backoff lasts."""
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
    return propose_ngram_drafts(
        request.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, limit
    )
