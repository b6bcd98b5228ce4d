"""KV cache sizing: explicit byte budgets, fractions of available memory, too-small budgets."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.kv_budget import available_memory_bytes, choose_num_blocks


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
