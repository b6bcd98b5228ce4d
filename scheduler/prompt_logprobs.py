"""ReportedPromptLogprobs: which prompt positions' logprobs a request has been given.

For a request that asks for prompt logprobs, positions below its mark have had their next
prompt token's logprob reported. The mark is kept across preemption, so a recompute reports
nothing twice, and dropped when the request finishes.
"""

from __future__ import annotations

from scheduler.output import RunnerOutput, ScheduledChunk, TokenLogprobs
from scheduler.request import Request


class ReportedPromptLogprobs:
    """Owns each asking request's mark (request id -> first unreported position)."""

    def __init__(self) -> None:
        self._reported: dict[str, int] = {}

    def positions(self, request: Request, start: int, end: int) -> range:
        """Positions of the chunk [start, end) whose next prompt token's logprob is still to
        be reported: [start, end) ∩ [reported, num_prompt_tokens - 1), or an empty range
        inside [start, end] (always, for a request that does not ask)."""
        if request.sampling_params.prompt_logprobs is None:
            return range(start, start)
        reported = self._reported.get(request.request_id, 0)
        first = min(max(start, reported), end)
        return range(first, max(first, min(end, request.num_prompt_tokens - 1)))

    def take(self, chunk: ScheduledChunk, runner_output: RunnerOutput) -> list[TokenLogprobs]:
        """The chunk's prompt logprobs, its positions marked reported (before the request can
        finish and drop its mark)."""
        if not chunk.num_prompt_logprob_rows:
            return []
        self._reported[chunk.request_id] = chunk.prompt_logprobs_end
        return runner_output.prompt_logprobs.get(chunk.request_id, [])

    def forget(self, request_id: str) -> None:
        self._reported.pop(request_id, None)
