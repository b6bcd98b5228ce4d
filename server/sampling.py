"""From an OpenAI request to engine inputs: model check, prompt checks, SamplingParams.

Everything here raises OpenAIError (400 or 404) naming the offending parameter, so routes
can turn any request into engine requests in a few lines.
"""

from __future__ import annotations

from scheduler.sampling_params import SamplingParams, SamplingParamsError
from server.errors import OpenAIError, bad_request
from server.protocol import SamplingFields

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def check_model(requested: str | None, served_names: tuple[str, ...]) -> str:
    """The model id to report; 404 when the client names a model this server does not serve."""
    if requested is None or requested in served_names:
        return served_names[0]
    raise OpenAIError(
        404,
        f"The model '{requested}' does not exist; this server serves: {', '.join(served_names)}",
        param="model",
        code="model_not_found",
    )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"token id {token_id} is out of range [0, {vocab_size})", param=param)


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_request_tokens: int,
    default: int | None,
    prompt_param: str,
) -> int:
    """max_tokens for one prompt; 400 when prompt + max_tokens does not fit the context."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty", param=prompt_param)
    if requested is not None and requested < 1:
        raise bad_request(f"max_tokens must be >= 1, got {requested}", param="max_tokens")
    room = max_request_tokens - num_prompt_tokens
    if requested is None:
        requested = room if default is None else min(default, max(room, 1))
    if num_prompt_tokens + requested > max_request_tokens:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_request_tokens} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion). Please reduce the length of the prompt "
            "or of max_tokens.",
            param=prompt_param if room < 1 else "max_tokens",
            code="context_length_exceeded",
        )
    return requested


def build_sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    choice_index: int,
) -> SamplingParams:
    """The engine's params for one choice. Choice i of a seeded request samples with seed+i,
    so n choices differ while the whole response stays reproducible."""
    stop_token_ids = tuple(body.stop_token_ids or ())
    check_token_ids(list(stop_token_ids), vocab_size, "stop_token_ids")
    seed = None if body.seed is None else body.seed + choice_index
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=_top_k(body.top_k),
            min_p=0.0 if body.min_p is None else body.min_p,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
            frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
            stop_token_ids=stop_token_ids,
            ignore_eos=body.ignore_eos,
            seed=seed,
            logprobs=logprobs,
            logit_bias=parse_logit_bias(body.logit_bias, vocab_size),
            report_progress=body.include_progress,
        )
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def _top_k(value: int | None) -> int:
    # vLLM spells "disabled" as -1; ours is 0. Accept both.
    if value is None or value == -1:
        return 0
    return value


def parse_logit_bias(
    raw: dict[str, float] | None, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """OpenAI sends {"token id as a string": bias}; keys must be token ids of this model."""
    if not raw:
        return ()
    pairs = []
    for key, bias in raw.items():
        if not key.strip().isdigit():
            raise bad_request(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                param="logit_bias",
            )
        token_id = int(key)
        check_token_ids([token_id], vocab_size, "logit_bias")
        pairs.append((token_id, float(bias)))
    return tuple(sorted(pairs))


def check_priority(priority: int, policy: str) -> int:
    """vLLM's rule: a priority other than 0 needs the priority scheduling policy (under fcfs
    it would be silently ignored)."""
    if priority != 0 and policy != "priority":
        raise bad_request(
            f"priority {priority} requires the server to run with --scheduling-policy priority "
            f"(it runs {policy})",
            param="priority",
        )
    return priority


def check_stop_strings(stop: list[str]) -> list[str]:
    for s in stop:
        if not s:
            raise bad_request("stop strings must not be empty", param="stop")
    return stop
