"""WeightLoader: gives a meta-device model its parameters from Hugging Face-named tensors.

Shared by every family (llama.py, gemma.py): one checkpoint tensor read at a time, cast to the
serving dtype and assigned, q/k/v and gate/up stacked into our fused layers (or taken as they
are where the checkpoint stores them fused under our name, as Phi-3 does), a tied LM head the
embedding's own tensor, and a loud failure on anything missing. Loading so holds one copy of
the weights, plus the tensor being read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from engine.models.gguf_linear import GGUFEmbedding, GGUFLinear

# Our fused linear layers and the Hugging Face weights stacked (by rows) into each.
LINEAR_SOURCES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class WeightLoader:
    """Reads `weights` (names with or without the "model." prefix) into `model`'s parameters,
    named as our modules name them ("layers.3.self_attn.qkv_proj.weight")."""

    def __init__(self, model: nn.Module, weights: Mapping[str, torch.Tensor], dtype) -> None:
        self.model = model
        self.weights = weights
        self.dtype = dtype
        self.names = {k.removeprefix("model."): k for k in weights}

    def has(self, name: str) -> bool:
        return name in self.names

    def read(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise ValueError(f"weight missing from checkpoint: {name}")
        return self.weights[self.names[name]]

    def put(self, ours: str, sources: tuple[str, ...] | None = None) -> None:
        """Parameter `ours` <- the sources stacked by rows (default: the tensor of that name)."""
        if sources is None or self.has(ours):  # stored fused already, under our name
            sources = (ours,)
        if self.in_blocks(sources):
            self._put_blocks(ours, sources)
            return
        target = self.model.get_parameter(ours)
        self.assign(ours, fuse(ours, [self.read(s) for s in sources], target.shape, self.dtype))

    def in_blocks(self, sources: tuple[str, ...]) -> bool:
        """Whether any of the sources is stored in a GGUF block format."""
        is_blocks = getattr(self.weights, "is_blocks", None)
        return is_blocks is not None and any(
            s in self.names and is_blocks(self.names[s]) for s in sources
        )

    def blocks(self, name: str):
        """A GGUF tensor as stored (GGUFBlocks, float kinds too), its rows stacked over any
        leading dimensions; None for a checkpoint that is not a GGUF file."""
        if getattr(self.weights, "read_blocks", None) is None:
            return None
        if name not in self.names:
            raise ValueError(f"weight missing from checkpoint: {name}")
        (stored,) = self.weights.read_blocks([self.names[name]])
        return stored

    def _put_blocks(self, ours: str, sources: tuple[str, ...]) -> None:
        """Linear `ours` ("....qkv_proj.weight") <- a GGUFLinear over the sources' blocks."""
        module_name, _, leaf = ours.rpartition(".")
        linear = self.model.get_submodule(module_name)
        if leaf != "weight" or not isinstance(linear, nn.Linear):
            raise ValueError(f"{ours}: a GGUF block-format tensor that is not a linear weight")
        missing = [s for s in sources if s not in self.names]
        if missing:
            raise ValueError(f"weight missing from checkpoint: {missing[0]}")
        parts = self.weights.read_blocks([self.names[s] for s in sources])
        if sum(p.rows for p in parts) != linear.out_features:
            raise ValueError(
                f"{ours}: GGUF rows {[p.rows for p in parts]} != {linear.out_features}"
            )
        gguf = GGUFLinear(parts, linear.in_features, linear.bias, self.dtype)
        self._replace(module_name, gguf)

    def _replace(self, module_name: str, module: nn.Module) -> None:
        parent, _, child = module_name.rpartition(".")
        setattr(self.model.get_submodule(parent), child, module)

    def assign(self, ours: str, tensor: torch.Tensor) -> None:
        module, _, leaf = ours.rpartition(".")
        param = nn.Parameter(tensor, requires_grad=False)
        setattr(self.model.get_submodule(module), leaf, param)

    def put_linears(self, prefix: str, skip: Callable[[str], bool] = lambda ours: False) -> None:
        """A layer's fused linear weights (those `skip` does not name). A model with an
        `on_linear_loaded(name)` callable (the runner's int8 quantization) has it called after
        each, so the layer can be converted before the next tensor is read."""
        hook = getattr(self.model, "on_linear_loaded", None)
        for ours, sources in LINEAR_SOURCES.items():
            if not skip(ours):
                self.put(f"{prefix}{ours}.weight", tuple(f"{prefix}{s}.weight" for s in sources))
                if hook is not None:
                    hook(f"{prefix}{ours}")

    def put_embeddings(self, tie_word_embeddings: bool) -> None:
        """The embedding, and the LM head: its own tensor, or the embedding's when tied (or
        when the checkpoint has none)."""
        if self.in_blocks(("embed_tokens.weight",)):
            self._put_block_embeddings(tie_word_embeddings)
            return
        self.put("embed_tokens.weight")
        if tie_word_embeddings or not self.has("lm_head.weight"):
            self.model.lm_head.weight = self.model.embed_tokens.weight  # one tensor serves both
        else:
            self.put("lm_head.weight")

    def _put_block_embeddings(self, tie_word_embeddings: bool) -> None:
        """A GGUF block-format embedding; a tied head (or none in the file) shares its blocks."""
        (table,) = self.weights.read_blocks([self.names["embed_tokens.weight"]])
        embedding = self.model.embed_tokens
        if (table.rows, table.cols) != (embedding.num_embeddings, embedding.embedding_dim):
            raise ValueError(f"embed_tokens: GGUF shape {(table.rows, table.cols)} differs")
        self.model.embed_tokens = GGUFEmbedding(table, self.dtype)
        if tie_word_embeddings or not self.has("lm_head.weight"):
            self.model.lm_head = GGUFLinear([table], table.cols, None, self.dtype)
        else:
            self.put("lm_head.weight")

    def check_complete(self) -> None:
        named = self.model.named_parameters(remove_duplicate=False)
        missing = [n for n, p in named if p.is_meta]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}")


def fuse(name: str, parts: list[torch.Tensor], shape: torch.Size, dtype) -> torch.Tensor:
    """parts stacked by rows, in dtype: one part is cast (no copy when already in dtype);
    several are written into one new tensor, so no stacked copy in the file's dtype exists."""
    rows = sum(p.shape[0] for p in parts)
    if (rows, *parts[0].shape[1:]) != tuple(shape):
        found = " + ".join(str(tuple(p.shape)) for p in parts)
        raise ValueError(f"{name}: checkpoint shape {found} != {tuple(shape)}")
    if len(parts) == 1:
        return parts[0].to(dtype).contiguous()
    fused = torch.empty(shape, dtype=dtype)
    first = 0
    for part in parts:
        fused[first : first + part.shape[0]].copy_(part)
        first += part.shape[0]
    return fused
