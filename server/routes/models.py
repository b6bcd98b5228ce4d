"""GET /v1/models: the model ids this server answers to; 503 while the model loads (its name is
not known before, and an empty list would read as a server that serves nothing)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.app_state import ready_client, served_model_names
from server.openai.protocol import ModelCard, ModelList, dump

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> dict:
    client = ready_client(request)
    created = request.app.state.started_at
    cards = [
        ModelCard(
            id=name,
            created=created,
            root=client.model_name or None,
            # What one request can really use: the context, or less when the KV budget holds
            # fewer tokens (a request needs its whole prompt + max_tokens in the cache).
            max_model_len=client.max_request_tokens or None,
        )
        for name in served_model_names(request)
    ]
    return dump(ModelList(data=cards))
