"""A request's fields as engine inputs: the model check, prompt and field checks, max_tokens,
SamplingParams (once per request, then per choice) and the text options of its choices.

Everything here raises OpenAIError (400 or 404) naming the offending parameter; the serving
core (server/openai/serving_core.py) calls it for every endpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scheduler.logit_bias import NO_LOGIT_BIAS
from scheduler.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput
from server.http.errors import OpenAIError, bad_request
from server.openai.protocol import SamplingFields
from server.openai.request_limits import check_logit_bias_range
from server.text.detokenizer import TextOptions, special_stop_tokens
from server.tool_calls import ToolCallFormat, ToolPolicy

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
    """400 naming the first id outside the vocabulary. min/max run in C: 64 prompts of 8k
    ids are checked in a few milliseconds, not a Python loop's tens on the event loop."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return
    bad = next(t for t in token_ids if not 0 <= t < vocab_size)
    raise bad_request(f"token id {bad} is out of range [0, {vocab_size})", param=param)


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
    tokenizer: Any = None,
    prompt_logprobs: int | None = None,
    structured_output: StructuredOutput | None = None,
) -> SamplingParams:
    """The engine's params for choice 0 of the request, built once per request: the other
    choices share them (choice_params), with their parsed LogitBias and stop list.

    A stop string that is exactly a special token's text ("<|im_end|>") also stops on that
    token's id: skip_special_tokens keeps the text from ever showing it, and as a stop id the
    engine holds it back until min_tokens like EOS (given `tokenizer`)."""
    stop_token_ids = tuple(body.stop_token_ids or ())
    check_token_ids(list(stop_token_ids), vocab_size, "stop_token_ids")
    if tokenizer is not None:
        special = special_stop_tokens(tokenizer, body.stop_strings)
        stop_token_ids += tuple(sorted(set(special) - set(stop_token_ids)))
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
            seed=body.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=check_logit_bias_range(body.logit_bias, vocab_size) or NO_LOGIT_BIAS,
            report_progress=body.include_progress,
            structured_output=structured_output,
        )
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of choices 0..n-1. Choice i of a seeded request samples with seed+i, so n
    choices differ while the whole response stays reproducible; an unseeded request's
    choices share one params object."""
    if params.seed is None:
        return [params] * n
    return [params] + [dataclasses.replace(params, seed=params.seed + i) for i in range(1, n)]


def with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """`params` for another prompt of the same request (only max_tokens may differ)."""
    if params.max_tokens == max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=max_tokens)


def text_options(body: SamplingFields, stop: list[str]) -> TextOptions:
    """How the choices' text is made: stop strings (checked) and vLLM's text options."""
    return TextOptions(
        stop=tuple(stop),
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
    )


def tool_text_options(options: TextOptions, fmt: ToolCallFormat, tools: ToolPolicy) -> TextOptions:
    """The text options, with special tokens' text kept when the calls' markers are special
    tokens (mistral's [TOOL_CALLS]) and calls are parsed, as vLLM's parsers ask for."""
    if fmt.needs_special_tokens and tools.parses_calls:
        return dataclasses.replace(options, skip_special_tokens=False)
    return options


def _top_k(value: int | None) -> int:
    # vLLM spells "disabled" as -1; ours is 0. Accept both.
    if value is None or value == -1:
        return 0
    return value


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
