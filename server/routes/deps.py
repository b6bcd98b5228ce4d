"""What route handlers take from app.state: settings, the engine client, served model names."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from server.detokenizer import TokenTexts
from server.engine_client import EngineClient
from server.errors import OpenAIError
from server.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_client(request: Request) -> EngineClient:
    return request.app.state.engine_client


def ready_client(request: Request) -> EngineClient:
    """The engine client once the model has loaded; 503 while loading or dead (a draining
    server still tokenizes; its submit() refuses generation with 503)."""
    client = get_client(request)
    if client.state in ("ready", "draining"):
        return client
    if client.state == "loading":
        raise OpenAIError(
            503,
            "the model is still loading; retry shortly",
            code="server_loading",
            headers={"Retry-After": "5"},
        )
    raise OpenAIError(503, f"the engine is not running: {client.error}", code="server_dead")


def served_model_names(request: Request) -> tuple[str, ...]:
    """The id clients use (--served-model-name, else the model's own name), then the
    model's own name as an alias."""
    client = get_client(request)
    configured = get_settings(request).served_model_name
    names = [configured] if configured else []
    if client.model_name and client.model_name not in names:
        names.append(client.model_name)
    return tuple(names)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_time() -> int:
    return int(time.time())


def token_texts(request: Request) -> TokenTexts:
    """Per-token strings for logprobs, memoized for the app's lifetime."""
    state = request.app.state
    texts = getattr(state, "token_texts", None)
    if texts is None:
        texts = TokenTexts(get_client(request).tokenizer)
        state.token_texts = texts
    return texts
