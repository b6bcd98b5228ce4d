"""When a request stops generating: the stop conditions checked after each sampled token."""

from __future__ import annotations

from scheduler.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The finished status the newest token `token_id` puts the request in, or None.

    Order: EOS and stop ids (only once min_tokens outputs exist, the same rule the sampler uses
    to mask them) -> FINISHED_STOPPED; then max_tokens or the context limit -> FINISHED_LENGTH.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_until_stop(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append token_ids in order, checking check_stop after each; tokens after the first that
    stops the request are dropped. Returns (the tokens appended, the finished status or None)."""
    for count, token_id in enumerate(token_ids, start=1):
        request.token_ids.append(token_id)
        status = check_stop(request, token_id, max_model_len)
        if status is not None:
            return token_ids[:count], status
    return list(token_ids), None
