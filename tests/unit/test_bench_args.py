"""`meterserve bench`'s decoding flags: greedy by default; sampled runs give request i the
seed seed+i, and the HF baseline samples the same way. No model is loaded here."""

from __future__ import annotations

import pytest

from engine.bench import decoding_label, hf_decoding_kwargs, parse_args, request_params


def test_greedy_is_the_default() -> None:
    args = parse_args([])
    assert (args.temperature, args.top_p, args.seed) == (0.0, 1.0, None)
    params = request_params(args, 3, 128)
    assert all(p.greedy and p.seed is None and p.ignore_eos for p in params)
    assert {p.max_tokens for p in params} == {128}
    assert decoding_label(args) == "greedy"
    assert hf_decoding_kwargs(args) == {"do_sample": False}


def test_sampled_requests_get_seed_plus_index() -> None:
    args = parse_args(["--temperature", "0.8", "--top-p", "0.95", "--seed", "100"])
    params = request_params(args, 4, 16)
    assert [p.seed for p in params] == [100, 101, 102, 103]
    assert all(p.temperature == 0.8 and p.top_p == 0.95 and not p.greedy for p in params)
    single = request_params(args, 1, 65, first=64)[0]  # the single stream follows the batch
    assert single.seed == 164 and single.max_tokens == 65
    assert request_params(args, 4, 16) == params  # reproducible
    assert hf_decoding_kwargs(args) == {
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 0,
    }
    assert decoding_label(args) == "sampled (temperature 0.8, top_p 0.95, seed 100+i)"


def test_unseeded_sampling_sends_no_seed() -> None:
    args = parse_args(["--temperature", "1.0"])
    assert all(p.seed is None for p in request_params(args, 2, 8))


@pytest.mark.parametrize("flags", [["--temperature", "3"], ["--top-p", "0"], ["--top-p", "1.5"]])
def test_out_of_range_decoding_flags_are_rejected(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(flags)


def test_random_model_flags() -> None:
    args = parse_args(["--random-model", "1.5b", "--model-dir", "/tmp/x"])
    assert (args.random_model, args.model_dir, args.model) == ("1.5b", "/tmp/x", "default")
    for wrong in (
        ["--random-model", "0.5b", "--model", "/some/dir"],  # two models named
        ["--model-dir", "/tmp/x"],  # a build directory with nothing to build
        ["--random-model", "7b"],  # not a size the bench builds
    ):
        with pytest.raises(SystemExit):
            parse_args(wrong)
