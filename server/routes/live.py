"""GET /v1/meterserve/live: the engine's last minute as JSON, for the web console's live view.

A meterserve extension (docs/console.md lists every field): the current batch (running,
waiting, KV-cache use) and one-second series and one-minute totals of MFU, MBU, tokens/s and
cost per 1M tokens, from server/metering/live_window.py. Protected by the API key like the other API
routes; 503 until the model has loaded.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.http.errors import OpenAIError

router = APIRouter()


@router.get("/v1/meterserve/live")
async def live(request: Request) -> dict[str, Any]:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is None:
        raise OpenAIError(
            503,
            "the model is still loading; retry shortly",
            code="server_loading",
            headers={"Retry-After": "5"},
        )
    return metrics.live.snapshot()
