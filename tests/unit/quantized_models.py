"""Shared by the int8 and int4 serving tests: a small engine over a tiny checkpoint, teacher-
forced prompt logprobs, and a checkpoint holding the weights a quantized engine multiplies by."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.llm import LLM
from engine.models.weight_loader import LINEAR_SOURCES
from scheduler.sampling_params import SamplingParams


def tiny_engine(path: Path, quantization: str = "none") -> LLM:
    return LLM(
        model=str(path),
        dtype="bfloat16",
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=16,
        quantization=quantization,
    )


def prompt_logprobs(llm: LLM, token_ids: list[int]):
    """Teacher-forced: the logprob of each token after the first, and at each position the
    model's top-2 (token ids, logprobs)."""
    llm.engine.add_request("p", token_ids, SamplingParams(max_tokens=1, prompt_logprobs=2))
    values: list[float] = []
    tops: list[tuple[list[int], list[float]]] = []
    while llm.engine.has_unfinished_requests():
        for event in llm.engine.step().events:
            values.extend(entry.logprob for entry in event.prompt_logprobs)
            tops.extend((e.top_token_ids, e.top_logprobs) for e in event.prompt_logprobs)
    return torch.tensor(values), tops


def save_with_weights(
    model, weight_of: Callable[[str], torch.Tensor], source: Path, path: Path
) -> None:
    """`model` (the HF model of the checkpoint at source) with every decoder linear's weight
    replaced by weight_of(our fused module name), each fused layer split back into the
    checkpoint's linears; saved with source's tokenizer files at path."""
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for fused, sources in LINEAR_SOURCES.items():
                weight = weight_of(f"layers.{index}.{fused}")
                first = 0
                for name in sources:
                    target = layer.get_submodule(name).weight
                    target.copy_(weight[first : first + target.shape[0]])
                    first += target.shape[0]
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            (path / name).write_bytes((source / name).read_bytes())
