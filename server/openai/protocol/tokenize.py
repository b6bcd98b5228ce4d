"""vLLM's /tokenize and /detokenize request models."""

from __future__ import annotations

from server.openai.protocol.chat import ChatMessage
from server.openai.protocol.request_fields import RequestModel


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM's: each token's string next to its id


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
