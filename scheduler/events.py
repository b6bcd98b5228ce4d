"""What the scheduler hands a request's consumer after a step: its TokenEvent and, for a
request that asked (SamplingParams.report_progress), the step's ChunkProgress."""

from __future__ import annotations

import dataclasses

from scheduler.output import ChunkProgress, ScheduledChunk, SchedulerOutput, TokenEvent
from scheduler.request import Request


def token_event(request: Request, token_ids: list[int] | None, now: float | None) -> TokenEvent:
    """The event of `token_ids` just appended (none: a token-less event); the request's times
    and cost ride on it once it has finished."""
    finished = request.is_finished
    return TokenEvent(
        request_id=request.request_id,
        new_token_ids=token_ids or [],
        finish_reason=request.finish_reason,
        error=request.error,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_output_tokens=request.num_output_tokens,
        produced_at=now,
        arrival_time=request.arrival_time,
        times=request.times if finished else None,
        cost=request.cost if finished else None,
    )


def chunk_progress(
    output: SchedulerOutput,
    chunk: ScheduledChunk,
    request: Request,
    now: float,
    num_accepted_draft_tokens: int,
) -> ChunkProgress:
    """What this step computed for the request, its cost so far copied (it crosses threads)."""
    assert output.step_index is not None
    return ChunkProgress(
        step_index=output.step_index,
        is_decode=chunk.is_decode,
        start_position=chunk.start_position,
        num_new_tokens=len(chunk.token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        num_scheduled_requests=len(output.chunks),
        computed_at=now,
        cost=dataclasses.replace(request.cost),
        num_draft_tokens=chunk.num_draft_tokens,
        num_accepted_draft_tokens=num_accepted_draft_tokens,
    )
