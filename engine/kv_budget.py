"""How many KV blocks to allocate: from a byte budget, or a fraction of available memory."""

from __future__ import annotations

from engine.config import EngineConfig

MIN_BLOCKS = 4


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); 4 GiB if unreadable."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def choose_num_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    budget = config.kv_cache_bytes
    if budget is None:
        budget = int(available_memory_bytes() * config.kv_cache_memory_fraction)
    num_blocks = budget // bytes_per_block
    if num_blocks < MIN_BLOCKS:
        raise ValueError(
            f"KV cache budget {budget} bytes holds {num_blocks} blocks of {bytes_per_block} bytes;"
            f" at least {MIN_BLOCKS} are needed"
        )
    return num_blocks
