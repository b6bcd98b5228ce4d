"""Model families. Dispatch is on config.model_type (GGUF-derived configs have no architectures)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

MODEL_FAMILIES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}
