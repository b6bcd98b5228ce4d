"""The workload generator: length distributions, determinism under a seed, shared-prefix and
multi-turn sessions, exact prompt lengths with the model's tokenizer. No server, no locust."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from loadtest.text import TextSource, load_corpus, load_tokenizer
from loadtest.workload import (
    EndpointMix,
    Fixed,
    LogNormal,
    Pareto,
    Uniform,
    Workload,
    WorkloadConfig,
    build_config,
    parse_length,
)


@pytest.fixture(scope="module")
def approx() -> TextSource:
    return TextSource(None)


@pytest.fixture(scope="module")
def exact() -> TextSource:
    return TextSource(load_tokenizer("default"))


def samples(dist, n: int = 20_000, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


def test_parse_length_specs() -> None:
    assert parse_length("128") == Fixed(128)
    assert parse_length("fixed,n=64") == Fixed(64)
    assert parse_length("uniform,low=32,high=256") == Uniform(32, 256)
    assert parse_length("lognormal,median=128,sigma=0.8,max=1024") == LogNormal(128, 0.8, 1, 1024)
    assert parse_length("pareto,scale=32,alpha=1.5,min=40,max=2048") == Pareto(32, 1.5, 40, 2048)
    for bad in ("0", "gauss,mu=3", "uniform,low=9,high=3", "uniform,low=3", "pareto,scale=1,a=2",
                "lognormal,median=-1,sigma=1"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_length(bad)


def test_fixed_and_uniform_distributions() -> None:
    assert set(samples(Fixed(77), 100)) == {77}
    values = samples(Uniform(10, 20))
    assert min(values) == 10 and max(values) == 20  # both ends inclusive and reached
    assert statistics.mean(values) == pytest.approx(15, abs=0.1)


def test_lognormal_is_long_tailed_with_the_given_median_and_clipped() -> None:
    values = samples(LogNormal(median=100, sigma=1.0, min_tokens=1, max_tokens=100_000))
    assert statistics.median(values) == pytest.approx(100, rel=0.05)
    assert statistics.mean(values) == pytest.approx(100 * math.exp(0.5), rel=0.08)
    assert statistics.mean(values) > statistics.median(values) * 1.4  # right tail
    clipped = samples(LogNormal(median=100, sigma=1.0, min_tokens=50, max_tokens=300))
    assert min(clipped) == 50 and max(clipped) == 300


def test_pareto_tail_follows_alpha_and_is_clipped() -> None:
    values = samples(Pareto(scale=32, alpha=2.0, max_tokens=1_000_000))
    assert min(values) >= 32
    # P(n > 4·scale) = 4 ** -alpha = 1/16
    tail = sum(v > 128 for v in values) / len(values)
    assert tail == pytest.approx(1 / 16, abs=0.01)
    assert max(samples(Pareto(scale=32, alpha=1.1, max_tokens=500))) == 500


def test_same_seed_same_sessions_other_seed_other_sessions(approx: TextSource) -> None:
    config = build_config("single", seed=7, input_tokens="uniform,low=20,high=200",
                          output_tokens="lognormal,median=30,sigma=0.5,max=100")  # fmt: skip
    first = [Workload(config, approx).session(i) for i in range(50)]
    again = [Workload(config, approx).session(i) for i in reversed(range(50))][::-1]
    assert first == again  # session i depends on (seed, i) only, not on order of creation
    other = Workload(build_config("single", seed=8, input_tokens="uniform,low=20,high=200"), approx)
    assert [s.turns for s in first] != [other.session(i).turns for i in range(50)]
    assert len({s.turns[0].user_text for s in first}) == 50  # prompts differ between sessions
    assert {s.endpoint for s in first} == {"chat_stream", "chat", "completions_stream",
                                           "completions"}  # fmt: skip


def test_endpoint_mix_weights(approx: TextSource) -> None:
    mix = EndpointMix.parse("chat_stream=3,completions=1")
    config = WorkloadConfig(mix=mix)
    kinds = [Workload(config, approx).session(i).endpoint for i in range(4000)]
    assert set(kinds) == {"chat_stream", "completions"}
    assert kinds.count("chat_stream") / len(kinds) == pytest.approx(0.75, abs=0.03)
    with pytest.raises(ValueError):
        EndpointMix.parse("chat_stream=0")
    with pytest.raises(ValueError):
        EndpointMix.parse("images=1")


def test_shared_prefix_mode_puts_one_system_prompt_first(exact: TextSource) -> None:
    workload = Workload(build_config("shared-prefix", seed=3, input_tokens="40"), exact)
    sessions = [workload.session(i) for i in range(20)]
    prefix = sessions[0].system_prompt
    assert prefix is not None and exact.count_tokens(prefix) == 256
    assert all(s.system_prompt == prefix for s in sessions)
    for s in sessions:
        assert s.messages(0, [])[0] == {"role": "system", "content": prefix}
        assert s.prompt(0, []).startswith(prefix + "\n\n")
    # random corpus offsets: two of 20 sessions may (rarely) land on the same window
    assert len({s.turns[0].user_text for s in sessions}) >= 18
    assert Workload(build_config("single"), exact).session(0).system_prompt is None


def test_multi_turn_sessions_carry_the_history(approx: TextSource) -> None:
    workload = Workload(build_config("multi-turn", seed=1, input_tokens="30"), approx)
    session = workload.session(5)
    assert session.num_turns == 3
    replies = ["first answer", "second answer"]
    messages = session.messages(2, replies)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2 + ["user"]
    assert [m["content"] for m in messages[1::2]] == replies
    assert [m["content"] for m in messages[0::2]] == [t.user_text for t in session.turns]
    prompt = session.prompt(2, replies)
    assert prompt.endswith(f"User: {session.turns[2].user_text}\nAssistant:")
    assert "Assistant: first answer" in prompt and "Assistant: second answer" in prompt
    assert build_config("multi-turn", num_turns=5).num_turns == 5


def test_exact_lengths_with_the_model_tokenizer(exact: TextSource) -> None:
    for offset, n in [(0, 128), (1234, 128), (7000, 300), (5, 1), (3, 17)]:
        text = exact.text(offset, n)
        assert exact.count_tokens(text) == n, (offset, n, text[:80])
    # windows wrap around the end of the corpus
    assert exact.count_tokens(exact.text(exact.num_positions - 10, 64)) == 64


def test_approximate_lengths_and_corpus(approx: TextSource) -> None:
    corpus = load_corpus()
    assert "We the People" in corpus and "Four score and seven years ago" in corpus
    text = approx.text(100, 100)
    assert len(text.split()) == round(100 * approx.words_per_token)
    assert approx.count_tokens(text) == pytest.approx(100, abs=1)
