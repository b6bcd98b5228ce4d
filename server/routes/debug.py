"""GET /debug/engine: engine facts for tests and operators (blocks, batch sizes, invariants).

The engine thread answers between steps; when it does not answer within
ENGINE_ANSWER_TIMEOUT_S (a very long step, or a wedged one) the route answers 503 instead of
hanging with it. The router sits behind the API key (server/app.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.app_state import get_client

router = APIRouter()

ENGINE_ANSWER_TIMEOUT_S = 5.0


@router.get("/debug/engine")
async def engine_info(request: Request) -> dict:
    return await get_client(request).debug_info(timeout=ENGINE_ANSWER_TIMEOUT_S)
