"""Model families. Dispatch is on config.model_type (GGUF-derived configs have no architectures)."""

from __future__ import annotations

from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaForCausalLM

MODEL_FAMILIES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "granite": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
}

# model types refused at start with the reason (a clear error instead of a wrong model).
REFUSED_MODEL_TYPES: dict[str, str] = {
    "gemma3": "the multimodal Gemma 3 wrapper; serve its text model (model_type gemma3_text)",
}
