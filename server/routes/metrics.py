"""GET /metrics: the Prometheus exposition of app.state.metrics (a ServerMetrics)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    server_metrics = getattr(request.app.state, "metrics", None)
    if server_metrics is None:
        # The engine builds the metrics once the model has loaded; until then a scrape fails
        # (Prometheus records up=0) rather than exporting made-up zeros.
        return Response("model loading: no metrics yet\n", status_code=503, media_type="text/plain")
    body, content_type = server_metrics.render()
    return Response(content=body, media_type=content_type)
