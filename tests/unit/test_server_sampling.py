"""From OpenAI request fields to SamplingParams: context checks, logit_bias, seeds, errors."""

from __future__ import annotations

import pytest

from server.errors import OpenAIError
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.sampling import (
    build_sampling_params,
    check_model,
    parse_logit_bias,
    resolve_max_tokens,
)

VOCAB = 1000


def test_resolve_max_tokens_defaults_and_limits():
    assert resolve_max_tokens(None, 10, 100, 16, "prompt") == 16
    assert resolve_max_tokens(None, 10, 100, None, "messages") == 90  # the rest of the context
    assert resolve_max_tokens(90, 10, 100, None, "prompt") == 90
    with pytest.raises(OpenAIError) as info:
        resolve_max_tokens(91, 10, 100, None, "prompt")
    error = info.value
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert error.param == "max_tokens"
    assert "100 tokens" in error.message and "101 tokens" in error.message
    assert "10 in the prompt" in error.message and "91 for the completion" in error.message
    with pytest.raises(OpenAIError) as info:
        resolve_max_tokens(None, 100, 100, 16, "messages")
    assert info.value.param == "messages"
    with pytest.raises(OpenAIError, match="max_tokens must be >= 1"):
        resolve_max_tokens(0, 10, 100, None, "prompt")
    with pytest.raises(OpenAIError, match="prompt is empty"):
        resolve_max_tokens(5, 0, 100, None, "prompt")


def test_logit_bias_keys_are_token_ids():
    assert parse_logit_bias({"7": 1.5, "3": -100}, VOCAB) == ((3, -100.0), (7, 1.5))
    assert parse_logit_bias(None, VOCAB) == ()
    for bad in ({"abc": 1}, {"-1": 1}, {"1000": 1}):
        with pytest.raises(OpenAIError) as info:
            parse_logit_bias(bad, VOCAB)
        assert info.value.param == "logit_bias" and info.value.status == 400


def test_build_sampling_params_maps_fields_and_offsets_seeds():
    body = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 10,
         "stop_token_ids": [5], "logit_bias": {"4": 2}, "ignore_eos": True, "min_tokens": 2}
    )  # fmt: skip
    params = [
        build_sampling_params(body, max_tokens=8, logprobs=2, vocab_size=VOCAB, choice_index=i)
        for i in range(2)
    ]
    assert [p.seed for p in params] == [10, 11]
    first = params[0]
    assert (first.temperature, first.top_p, first.top_k) == (0.5, 0.9, 0)
    assert first.stop_token_ids == (5,) and first.logit_bias == ((4, 2.0),)
    assert first.ignore_eos and first.min_tokens == 2 and first.max_tokens == 8
    assert first.logprobs == 2


def test_out_of_range_values_name_the_parameter():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}
    )
    with pytest.raises(OpenAIError) as info:
        build_sampling_params(body, max_tokens=4, logprobs=None, vocab_size=VOCAB, choice_index=0)
    assert info.value.param == "frequency_penalty" and info.value.status == 400


def test_check_model():
    assert check_model(None, ("smol", "SmolLM2")) == "smol"
    assert check_model("SmolLM2", ("smol", "SmolLM2")) == "smol"
    with pytest.raises(OpenAIError) as info:
        check_model("gpt-9", ("smol",))
    assert info.value.status == 404 and info.value.code == "model_not_found"
