"""SamplingParams: valid defaults, and every out-of-range value names its parameter."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.logit_bias import LogitBias
from scheduler.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert not params.greedy and not params.uses_penalties
    assert params.stop_token_ids == () and params.logprobs is None and params.seed is None


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.5).uses_penalties


def test_is_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
    ],
)
def test_out_of_range_raises_with_param(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    assert param.split("_")[0] in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"min_tokens": 4, "max_tokens": 4},
        {"repetition_penalty": 2.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"logit_bias": LogitBias.of(((5, -100.0), (6, 100.0)))},
    ],
)
def test_boundary_values_are_valid(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (((-1, 1.0),), "negative"),
        (((5, 100.5),), "not in"),
        (((5, 1.0), (5, 2.0)), "twice"),
    ],
)
def test_logit_bias_checks_its_entries_once(pairs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LogitBias.of(pairs)


def test_logit_bias_is_sorted_and_reads_below_a_vocabulary() -> None:
    bias = LogitBias.of(((9, 1.0), (2, -3.5), (5, 0.25)))
    assert list(bias.token_ids) == [2, 5, 9] and list(bias.values) == [-3.5, 0.25, 1.0]
    assert (bias.num_below(9), bias.num_below(10), bias.num_below(0)) == (2, 3, 0)
    assert bias and len(bias) == 3 and not LogitBias()
