"""How a sampled chunk's tokens join its request in update(): the drafts the model accepted
(scheduler rule 10; their KV is computed) and the token sampled after them, each checked
against the stop conditions, and the TokenEvent that hands them over."""

from __future__ import annotations

from collections.abc import Callable

from scheduler.events import token_event
from scheduler.output import RunnerOutput, TokenEvent
from scheduler.request import Request, RequestStatus
from scheduler.stop import append_until_stop

# Scheduler._finish: the final state, blocks freed, before the event reads the request.
Finish = Callable[[Request, RequestStatus, str | None], None]


def append_sampled_tokens(
    request: Request, runner_output: RunnerOutput, max_model_len: int, now: float, finish: Finish
) -> TokenEvent:
    """Append the accepted drafts and the sampled token, checking the stop conditions after
    each; tokens after a stop are dropped. A request the runner sampled nothing for fails."""
    request_id = request.request_id
    token_id = runner_output.sampled_token_ids.get(request_id)
    if token_id is None:
        finish(request, RequestStatus.FINISHED_ERROR, "model runner sampled no token")
        return token_event(request, None, None)
    accepted = runner_output.accepted_draft_token_ids.get(request_id, [])
    logprobs = runner_output.accepted_logprobs.get(request_id, [])
    last = runner_output.logprobs.get(request_id)
    logprobs = logprobs + [last] if last is not None else logprobs
    appended, status = append_until_stop(request, [*accepted, token_id], max_model_len)
    if status is not None:
        finish(request, status, None)
    if not request.is_finished:
        request.num_computed_tokens += len(accepted)
    times = request.times
    previous = times.last_token
    if times.first_token is None:
        times.first_token = now
    times.last_token = now
    event = token_event(request, appended, now)
    event.previous_token_at = previous
    event.logprobs.extend(logprobs[: len(appended)])
    return event
