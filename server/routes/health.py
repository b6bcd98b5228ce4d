"""GET /health: 200 while the engine serves; 503 while loading, draining, dead or stalled.

One endpoint answers both probes. Readiness: 503 while the model loads and while the server
drains, so a load balancer routes elsewhere. Liveness: 503 when the engine thread has died,
or when requests are pending and it has not finished a step for --engine-stall-timeout
seconds (a wedged native call, a deadlock), so the orchestrator restarts the process. A
liveness probe must tolerate loading (a startup probe) and a whole drain (its failure
threshold); the body's `status` says which case it is.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from server.app_state import get_client
from server.http.errors import OpenAIError

router = APIRouter()

_WHY = {
    "loading": "the model is still loading",
    "draining": "the server is shutting down (draining in-flight requests)",
}


@router.get("/health")
async def health(request: Request) -> Response:
    client = get_client(request)
    state = client.state
    live = client.liveness()
    if live.dead or state == "dead":
        why = client.error or "the engine thread has exited"
        error = OpenAIError(503, f"the engine is not running: {why}", code="server_dead")
        return _unavailable(error, "dead")
    if live.stalled:
        message = (
            f"the engine has not finished a step for {live.seconds_since_step:.1f} s "
            f"while {live.num_pending} request(s) are pending"
        )
        return _unavailable(
            OpenAIError(503, message, code="engine_stalled"),
            "stalled",
            seconds_since_last_step=round(live.seconds_since_step, 3),
            num_pending_requests=live.num_pending,
        )
    if state == "ready":
        return JSONResponse({"status": "ok"})
    return _unavailable(OpenAIError(503, _WHY[state], code=f"server_{state}"), state)


def _unavailable(error: OpenAIError, status: str, **facts: object) -> JSONResponse:
    return JSONResponse(error.body() | {"status": status, **facts}, status_code=503)
