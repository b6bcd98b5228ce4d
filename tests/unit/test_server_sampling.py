"""From OpenAI request fields to SamplingParams: context checks, logit_bias, seeds, errors."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server.http.body import parse_body
from server.http.errors import OpenAIError
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.request_limits import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    check_num_choices,
)
from server.openai.request_params import (
    build_sampling_params,
    check_model,
    choice_params,
    resolve_max_tokens,
    with_max_tokens,
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


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_logit_bias_keys_are_token_ids():
    bias = _completion(logit_bias={"7": 1.5, "3": -100}).logit_bias
    assert bias.pairs() == [(3, -100.0), (7, 1.5)]
    assert _completion().logit_bias is None
    for bad in ({"abc": 1}, {"-1": 1}, {"7": 1, "07": 2}, {"4": 500}, {"4": True}, {"4": "1"}):
        with pytest.raises(ValidationError) as info:
            _completion(logit_bias=bad)
        assert info.value.errors()[0]["loc"] == ("logit_bias",)
    body = _completion(logit_bias={"999": 1, "1000": 1})
    with pytest.raises(OpenAIError) as error:
        build_sampling_params(body, max_tokens=4, logprobs=None, vocab_size=VOCAB)
    assert error.value.param == "logit_bias" and "1000" in error.value.message


def test_build_sampling_params_maps_fields_and_offsets_seeds():
    body = _completion(
        temperature=0.5, top_p=0.9, top_k=-1, seed=10, stop_token_ids=[5],
        logit_bias={"4": 2}, ignore_eos=True, min_tokens=2,
    )  # fmt: skip
    params = choice_params(
        build_sampling_params(body, max_tokens=8, logprobs=2, vocab_size=VOCAB), 3
    )
    assert [p.seed for p in params] == [10, 11, 12]
    first = params[0]
    assert (first.temperature, first.top_p, first.top_k) == (0.5, 0.9, 0)
    assert first.stop_token_ids == (5,) and first.logit_bias.pairs() == [(4, 2.0)]
    assert first.ignore_eos and first.min_tokens == 2 and first.max_tokens == 8
    assert first.logprobs == 2
    # One parsed bias and one stop list, shared by every choice (not re-built per choice).
    assert all(p.logit_bias is first.logit_bias for p in params)
    assert all(p.stop_token_ids is first.stop_token_ids for p in params)
    assert with_max_tokens(first, 8) is first and with_max_tokens(first, 3).max_tokens == 3


def test_unseeded_choices_share_one_params_object():
    params = build_sampling_params(_completion(), max_tokens=4, logprobs=None, vocab_size=VOCAB)
    assert choice_params(params, 4) == [params] * 4
    assert all(p is params for p in choice_params(params, 4))


def test_whole_vocabulary_logit_bias_is_parsed_once_from_the_body():
    """A bias over every token is one LogitBias, validated with the body (parse_body, off
    the event loop for a large body), shared by all choices."""
    vocab = 49_152
    raw = json.dumps({"prompt": "x", "n": 16, "logit_bias": {str(i): -1 for i in range(vocab)}})
    body = parse_body(raw.encode(), CompletionRequest)
    params = choice_params(
        build_sampling_params(body, max_tokens=4, logprobs=None, vocab_size=vocab), body.n
    )
    assert len(params[0].logit_bias) == vocab
    assert {id(p.logit_bias) for p in params} == {id(body.logit_bias)}


def test_size_limits_name_their_field():
    cases = [
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"n": 17}, "n"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
    ]
    for fields, param in cases:
        with pytest.raises(ValidationError) as info:
            _completion(**fields)
        assert info.value.errors()[0]["loc"][0] == param, fields
    with pytest.raises(OpenAIError) as error:
        check_num_choices(64, 2, 64, "prompt")
    assert error.value.param == "n" and "128 choices" in error.value.message
    with pytest.raises(OpenAIError) as error:
        check_num_choices(65, 1, 64, "prompt")
    assert error.value.param == "prompt"
    check_num_choices(64, 1, 64, "prompt")


def test_out_of_range_values_name_the_parameter():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}
    )
    with pytest.raises(OpenAIError) as info:
        build_sampling_params(body, max_tokens=4, logprobs=None, vocab_size=VOCAB)
    assert info.value.param == "frequency_penalty" and info.value.status == 400


def test_check_model():
    assert check_model(None, ("smol", "SmolLM2")) == "smol"
    assert check_model("SmolLM2", ("smol", "SmolLM2")) == "smol"
    with pytest.raises(OpenAIError) as info:
        check_model("gpt-9", ("smol",))
    assert info.value.status == 404 and info.value.code == "model_not_found"
