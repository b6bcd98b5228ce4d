"""GET /metrics: the Prometheus exposition of app.state.metrics (a ServerMetrics).

Public, as in vLLM, so any Prometheus scrapes it without a key. The per-tenant series (who is
billed what, server/metering/tenant_metrics.py) are shown to every scrape only while the server has
neither API keys (then every route is open anyway) nor --metrics-api-key. Otherwise only a
scrape that sends `Authorization: Bearer <--metrics-api-key>` gets them; any other, a tenant's
own API key included, gets the aggregate series. --metrics-port serves the full exposition on
a listener of its own (MetricsListener), bound where --metrics-host says.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request, Response

from server.settings import Settings
from server.tenancy.auth import parse_bearer
from server.tenancy.tenants import key_matches

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    settings: Settings | None = getattr(request.app.state, "settings", None)
    # An app without settings (a test's bare router) has no keys: everything is open.
    full = settings is None or shows_tenants(settings, request.headers.get("authorization"))
    response = _exposition(request.app, include_tenants=full)
    response.headers["Vary"] = "Authorization"
    return response


def shows_tenants(settings: Settings, authorization: str | None) -> bool:
    """Whether a scrape of the main port's /metrics with this Authorization header sees the
    per-tenant series."""
    if settings.metrics_api_key is None:
        return not settings.tenants.requires_auth
    token = parse_bearer(authorization)
    return token is not None and key_matches(token, (settings.metrics_api_key,))


def _exposition(app: FastAPI, *, include_tenants: bool) -> Response:
    server_metrics = getattr(app.state, "metrics", None)
    if server_metrics is None:
        # The engine builds the metrics once the model has loaded; until then a scrape fails
        # (Prometheus records up=0) rather than exporting made-up zeros.
        return Response("model loading: no metrics yet\n", status_code=503, media_type="text/plain")
    body, content_type = server_metrics.render(include_tenants=include_tenants)
    return Response(content=body, media_type=content_type)


def full_metrics_app(app: FastAPI) -> FastAPI:
    """The --metrics-port application: GET /metrics of `app`'s metrics, tenants included."""
    listener = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @listener.get("/metrics")
    async def full_metrics() -> Response:
        return _exposition(app, include_tenants=True)

    return listener


class MetricsListener:
    """The --metrics-port listener: a second uvicorn server on the main server's event loop,
    serving full_metrics_app(app). start() binds the socket itself, so a port that is taken
    fails the application's start-up with a message that names the flag."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.host, self.port = host, port
        config = uvicorn.Config(
            full_metrics_app(app),
            lifespan="off",
            log_config=None,  # the main server configured logging already
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        self._server = _SignalFreeServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.create_server((self.host, self.port), family=family)
        except OSError as exc:
            raise RuntimeError(
                f"--metrics-port: cannot listen on {self.host}:{self.port}: {exc}"
            ) from exc
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what failed the start-up
                raise RuntimeError("--metrics-port: the metrics listener did not start")
            await asyncio.sleep(0.01)
        log.info("full /metrics (per-tenant series included) on %s port %d", self.host, self.port)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task


class _SignalFreeServer(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The main server (server/http/draining_server.py) owns SIGTERM and SIGINT; it stops
        # this one.
        yield
