"""N-gram drafts (scheduler/ngram_proposer.py) and the --speculative-config parser."""

from __future__ import annotations

import random

import pytest

from scheduler.ngram_proposer import propose_ngram_drafts
from scheduler.speculative_config import SpeculativeConfig


def reference_drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, by brute force: longest suffix first, latest earlier start."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_latest_occurrence_of_the_longest_suffix_proposes_what_followed() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert propose_ngram_drafts(tokens, 1, 3, 3) == [4, 5, 9]
    assert propose_ngram_drafts(tokens, 1, 3, 1) == [4]
    # Two earlier occurrences of [2, 3]: the later one wins.
    assert propose_ngram_drafts([2, 3, 8, 2, 3, 6, 2, 3], 2, 2, 2) == [6, 2]
    # The longest suffix wins over a later shorter one.
    assert propose_ngram_drafts([5, 2, 3, 7, 9, 3, 1, 5, 2, 3], 1, 3, 1) == [7]


def test_no_match_and_too_short_inputs_propose_nothing() -> None:
    assert propose_ngram_drafts([1, 2, 3], 1, 3, 2) == []
    assert propose_ngram_drafts([4], 1, 1, 2) == []
    assert propose_ngram_drafts([4, 4], 1, 1, 0) == []
    assert propose_ngram_drafts([1, 2, 1, 2], 3, 3, 2) == []  # min_n above every match


def test_drafts_stop_at_the_suffix_and_ids_past_one_byte_are_matched_whole() -> None:
    assert propose_ngram_drafts([7, 7, 7, 7], 1, 2, 5) == [7]
    # 256 = bytes 00 01 00 00: a byte-level hit across two ids must not count.
    assert propose_ngram_drafts([1, 256, 0, 1, 0, 256], 1, 1, 2) == [0, 1]
    big = 65536 * 3 + 1
    assert propose_ngram_drafts([1, big, 2, 1], 1, 1, 2) == [big, 2]


def test_matches_the_brute_force_definition_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.choice([0, 1, 2, 256, 257, 70000]) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        assert propose_ngram_drafts(tokens, min_n, max_n, k) == reference_drafts(
            tokens, min_n, max_n, k
        )


def test_config_reads_vllms_json_and_fills_one_lookup_size_from_the_other() -> None:
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        4,
        4,
        4,
    )
    config = SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "prompt_lookup_min": 2}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    assert config.max_backoff_steps == 8
    config = SpeculativeConfig.from_json('{"num_speculative_tokens": 2, "max_backoff_steps": 0}')
    assert config.max_backoff_steps == 0


def test_config_reads_a_draft_model_as_vllm_does() -> None:
    config = SpeculativeConfig.from_json('{"model": "/m/draft", "num_speculative_tokens": 3}')
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        "/m/draft",
        3,
    )
    config = SpeculativeConfig.from_json(
        '{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2, '
        '"max_backoff_steps": 0}'
    )
    assert (config.model, config.max_backoff_steps) == ("d.gguf", 0)
    with pytest.raises(ValueError, match="only"):
        SpeculativeConfig(num_speculative_tokens=2, method="draft_model")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not served"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "prompt_lookup"),
        ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}', "'ngram'.*model"),
        ('{"model": 3, "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"num_speculative_tokens": 0}', "must be in 1..16"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
        ('{"num_speculative_tokens": "2"}', "must be an integer"),
        ('{"num_speculative_tokens": 2, "max_backoff_steps": -1}', "max_backoff_steps"),
        ('{"num_speculative_tokens": 2, "disable_by_batch_size": 8}', "disable_by_batch_size"),
    ],
)
def test_config_refuses_what_it_does_not_serve_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)
