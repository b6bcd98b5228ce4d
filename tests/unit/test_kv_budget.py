"""KV cache sizing: explicit byte budgets, fractions of available memory, too-small budgets."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.kv_budget import available_memory_bytes, choose_num_blocks, request_token_capacity
from kvcache.window import max_live_blocks


def test_explicit_budget_gives_whole_blocks() -> None:
    config = EngineConfig(kv_cache_bytes=10 * 1000 + 999)
    assert choose_num_blocks(config, bytes_per_block=1000) == 10


def test_fraction_of_available_memory() -> None:
    config = EngineConfig(kv_cache_memory_fraction=0.01)
    expected = int(available_memory_bytes() * 0.01) // 4096
    assert choose_num_blocks(config, bytes_per_block=4096) == expected


def test_budget_below_four_blocks_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="holds 3 blocks of 1000 bytes"):
        choose_num_blocks(EngineConfig(kv_cache_bytes=3500), bytes_per_block=1000)


def test_available_memory_is_positive_and_bounded_by_meminfo() -> None:
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal"))
    assert 0 < available_memory_bytes() <= total


def test_reserved_null_block_counts_against_the_minimum() -> None:
    config = EngineConfig(kv_cache_bytes=4 * 1000)
    assert choose_num_blocks(config, bytes_per_block=1000) == 4
    with pytest.raises(
        ValueError, match=r"holds 4 blocks of 1000 bytes \(1 reserved\); at least 5"
    ):
        choose_num_blocks(config, bytes_per_block=1000, num_reserved=1)
    assert choose_num_blocks(EngineConfig(kv_cache_bytes=5000), 1000, num_reserved=1) == 5


def test_request_token_capacity_without_a_window_is_the_pool() -> None:
    assert request_token_capacity(10, 4, None, 8) == 40


def test_window_lifts_the_capacity_when_its_bound_fits_the_pool() -> None:
    # Window 8, chunks of up to 8, blocks of 4: positions s - 7 .. s + 7 span at most 5 blocks.
    assert max_live_blocks(8, 8, 4) == 5
    assert request_token_capacity(5, 4, 8, 8) is None  # any length: only max positions limit
    assert request_token_capacity(4, 4, 8, 8) == 16  # the bound does not fit: the pool does
    # Mistral v0.1: window 4096, 16-token blocks, 1024-token chunks: 5119 positions, 321 blocks.
    assert max_live_blocks(4096, 1024, 16) == 321
    assert request_token_capacity(321, 16, 4096, 1024) is None
    assert request_token_capacity(320, 16, 4096, 1024) == 320 * 16
