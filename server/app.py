"""create_app(settings): the FastAPI application, its lifespan and its routers.

The lifespan starts the engine thread, which loads the model in the background: the HTTP
server is up at once and /health answers 503 until the model is ready. Shutdown stops the
engine thread after ending whatever is still in flight. With --metrics-port it also runs the
second listener that serves the full /metrics (server/routes/metrics.py).

What answers without a key is listed here, once: /health, /metrics (the aggregate series), the
console's page and files. Every other router gets require_api_key; FastAPI's own /docs,
/redoc and /openapi.json are off (routes/openapi.py serves the document behind the key).
tests/unit/test_public_routes.py checks every registered route against this list.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI

from server.engine_client.client import EngineClient
from server.engine_client.exchange import GroupReleaseMiddleware
from server.http.errors import OpenAIError, install_error_handlers
from server.http.openapi import document_request_bodies
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.openai.protocol.responses import ResponsesRequest
from server.routes import (
    chat,
    completions,
    console,
    debug,
    health,
    live,
    models,
    responses,
    tokenize,
    version,
)
from server.routes import metrics as metrics_routes
from server.routes import openapi as openapi_routes
from server.routes.version import package_version
from server.settings import Settings
from server.tenancy.auth import require_api_key


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client: EngineClient = app.state.engine_client
        listener = None
        if settings.metrics_port is not None:
            listener = metrics_routes.MetricsListener(
                app, settings.metrics_host, settings.metrics_port
            )
            await listener.start()
        client.start()
        try:
            yield
        finally:
            if listener is not None:
                await listener.stop()
            await client.shutdown()

    app = FastAPI(
        title="meterserve",
        version=package_version(),
        lifespan=lifespan,
        # No Swagger UI or ReDoc (third-party scripts on the console's origin); the OpenAPI
        # document is served behind the key by routes/openapi.py.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    client = EngineClient(
        settings.engine,
        meter_config=settings.meter,
        max_waiting_requests=settings.max_waiting_requests,
        max_queued_tokens=settings.max_queued_tokens,
        request_timeout=settings.request_timeout,
        stall_timeout=settings.engine_stall_timeout,
        metrics_factory=lambda core: build_metrics(settings, core),
    )
    app.state.settings = settings
    app.state.started_at = int(time.time())
    app.state.engine_client = client
    app.state.metrics = None  # a ServerMetrics once the engine has loaded

    def on_ready() -> None:
        app.state.metrics = client.metrics

    def observe_error(error: OpenAIError) -> None:
        reason = _rejection_reason(error)
        if reason is not None:
            client.observe_rejection(reason)

    client.on_ready = on_ready
    app.state.observe_error = observe_error
    install_error_handlers(app)
    app.add_middleware(GroupReleaseMiddleware, client=client)
    # Probes and Prometheus reach these without a key (/metrics: the aggregate series).
    app.include_router(health.router)
    app.include_router(metrics_routes.router)
    app.include_router(console.router)  # the page is public; its API calls send the key
    protected = [Depends(require_api_key)]
    for module in (
        completions,
        chat,
        responses,
        models,
        tokenize,
        version,
        debug,
        live,
        openapi_routes,
    ):
        app.include_router(module.router, dependencies=protected)
    document_request_bodies(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
        },
    )
    return app


def build_metrics(settings: Settings, core: Any) -> Any:
    """The ServerMetrics for a loaded engine (runs on the engine thread, during load)."""
    from server.metering.prometheus_export import ServerMetrics

    return ServerMetrics(
        core.meter,
        settings.served_model_name or core.model_name,
        core.kv_cache_info,
        core.runner.num_params,
        max_num_seqs=settings.engine.max_num_seqs,
        tenants=settings.tenants.label_values,
    )


def _rejection_reason(error: OpenAIError) -> str | None:
    # Other 429s, 503s and timeouts are counted where they are raised (the engine client).
    if error.code == "grammar_compile_queue_full":
        return "grammar_queue_full"
    if error.status == 400 and error.code == "context_length_exceeded":
        return "context_length"
    if error.status in (400, 404, 413, 422):
        return "invalid_request"
    return None
