"""GET /debug/engine: engine facts for tests and operators (blocks, batch sizes, invariants)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.routes.deps import get_client

router = APIRouter()


@router.get("/debug/engine")
async def engine_info(request: Request) -> dict:
    return await get_client(request).debug_info()
