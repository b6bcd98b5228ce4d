"""A request's ScheduledChunk (what the runner computes for it this step), and the order of a
step's chunks."""

from __future__ import annotations

from scheduler.output import ScheduledChunk
from scheduler.request import Request


def scheduled_chunk(
    request: Request,
    num_new: int,
    drafts: list[int],
    block_table: list[int],
    prompt_logprob_positions: range,
) -> ScheduledChunk:
    """Positions [num_computed_tokens, + num_new) of the request, then its drafts; it samples
    when it reaches the end of the request's known tokens."""
    start = request.num_computed_tokens
    end = start + num_new
    return ScheduledChunk(
        request_id=request.request_id,
        token_ids=request.token_ids[start:end] + drafts,
        start_position=start,
        block_table=block_table,
        samples=end == request.num_tokens,
        num_prompt_tokens=request.num_prompt_tokens,
        sampling_params=request.sampling_params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        eos_token_ids=request.eos_token_ids,
        prompt_logprobs_start=prompt_logprob_positions.start,
        prompt_logprobs_end=prompt_logprob_positions.stop,
        draft_token_ids=drafts,
    )


def chunk_order(chunk: ScheduledChunk) -> int:
    """Single-token decodes first (the batch's decode rows), then decodes with drafts, then
    prefill chunks; sorted() keeps the policy order within each."""
    if not chunk.is_decode:
        return 2
    return 1 if chunk.draft_token_ids else 0
