"""KVCacheTensors: the per-layer key/value tensors addressed by slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVCacheTensors:
    """keys[layer] and values[layer] are [num_blocks * block_size, num_kv_heads, head_dim].

    slot = block_id * block_size + offset, so one index_copy_ writes a whole step's tokens.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> KVCacheTensors:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        return cls(keys, values, block_size)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def context_slots(block_table: list[int], context_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [0, context_len) of one request, in position order."""
    positions = torch.arange(context_len)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size
