"""How many KV blocks to allocate (from a byte budget, or a fraction of available memory),
and how many tokens one request can hold in them."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from kvcache.window import max_live_blocks

MIN_BLOCKS = 4


def available_memory_bytes() -> int:
    """Memory this process may still use: MemAvailable, capped by a cgroup (container) limit.

    4 GiB when nothing is readable. A container's limit is not visible in /proc/meminfo, so
    without the cgroup cap a pod would size its cache from the whole node's memory.
    """
    available = _meminfo_available()
    cgroup = _cgroup_headroom()
    candidates = [v for v in (available, cgroup) if v is not None]
    return min(candidates) if candidates else 4 * 2**30


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> int | None:
    """limit - current usage, from cgroup v2 (memory.max) or v1 (memory.limit_in_bytes)."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 2**60:  # no limit set
            return None
        return max(0, int(limit_text) - usage)
    return None


def choose_num_blocks(config: EngineConfig, bytes_per_block: int, num_reserved: int = 0) -> int:
    """Blocks the budget holds, the `num_reserved` ones (the sliding window's null block)
    included; at least MIN_BLOCKS must be left for requests."""
    budget = config.kv_cache_bytes
    if budget is None:
        budget = int(available_memory_bytes() * config.kv_cache_memory_fraction)
    num_blocks = budget // bytes_per_block
    if num_blocks - num_reserved < MIN_BLOCKS:
        reserved = f" ({num_reserved} reserved)" if num_reserved else ""
        raise ValueError(
            f"KV cache budget {budget} bytes holds {num_blocks} blocks of {bytes_per_block} bytes"
            f"{reserved}; at least {MIN_BLOCKS + num_reserved} are needed"
        )
    return num_blocks


def request_token_capacity(
    num_usable_blocks: int,
    block_size: int,
    sliding_window: int | None,
    max_request_step_tokens: int,
) -> int | None:
    """Prompt + output tokens the KV cache can hold for one request running alone; None when
    that is unbounded: every layer's window W caps the blocks a request holds at once
    (kvcache.window.max_live_blocks, with chunks of at most max_request_step_tokens) at no
    more than the pool, so only the model's max positions limit its length."""
    if sliding_window is not None:
        bound = max_live_blocks(sliding_window, max_request_step_tokens, block_size)
        if bound <= num_usable_blocks:
            return None
    return num_usable_blocks * block_size
