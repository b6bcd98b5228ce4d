"""GET /health: 200 while the engine serves; 503 while loading, draining or dead."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from server.errors import OpenAIError
from server.routes.deps import get_client

router = APIRouter()

_WHY = {
    "loading": "the model is still loading",
    "draining": "the server is shutting down (draining in-flight requests)",
}


@router.get("/health")
async def health(request: Request) -> Response:
    client = get_client(request)
    state = client.state
    if state == "ready":
        return JSONResponse({"status": "ok"})
    message = _WHY.get(state) or f"the engine is not running: {client.error}"
    error = OpenAIError(503, message, code=f"server_{state}")
    body = error.body() | {"status": state}
    return JSONResponse(body, status_code=503)
