"""What route handlers take from app.state (settings, the engine client, served model names),
how a generation becomes the HTTP response, and the middleware that makes sure every request
group a route submitted is released when its HTTP exchange ends."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.meter.billing import Prices
from server.cache_salt import cache_salt
from server.detokenizer import TextOptions, TokenTexts
from server.engine_client import EngineClient
from server.errors import OpenAIError
from server.generation import ClientDisconnected, Generation, until_disconnected
from server.protocol import dump
from server.request_group import BillingAccount, RequestGroup
from server.settings import Settings
from server.streaming import SSEResponse
from server.tenants import DEFAULT_TENANT_NAME
from server.tool_calls import FunctionTool, ToolCallFormat, ToolPolicy, tool_call_format


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


def billing_account(request: Request) -> BillingAccount:
    """Whom this request is billed to (auth resolved the tenant) and at which prices."""
    client = get_client(request)
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:
        return client.default_account()
    label = get_settings(request).tenants.label(tenant.name)
    if tenant.plan is None:
        return client.default_account(label)
    plan = tenant.plan
    return BillingAccount(
        label,
        Prices(plan.price_per_million_input_tokens, plan.price_per_million_output_tokens),
    )


def engine_cache_salt(request: Request, client_salt: str | None) -> str:
    """The prefix-cache salt of this request's engine requests: its tenant's (unless the
    operator shares the cache across tenants) and the client's `cache_salt`."""
    tenant = getattr(request.state, "tenant", None)
    name = tenant.name if tenant is not None else DEFAULT_TENANT_NAME
    return cache_salt(name, client_salt, get_settings(request).shared_prefix_cache)


def tool_format(request: Request, tools: Sequence[FunctionTool]) -> ToolCallFormat:
    """The format this server's model writes tool calls in (--tool-call-parser; auto reads
    the chat template), for a request's tools."""
    template = getattr(get_client(request).tokenizer, "chat_template", None)
    return tool_call_format(get_settings(request).tool_call_parser, template, tools)


def tool_text_options(options: TextOptions, fmt: ToolCallFormat, tools: ToolPolicy) -> TextOptions:
    """The text options, with special tokens' text kept when the calls' markers are special
    tokens (mistral's [TOOL_CALLS]) and calls are parsed, as vLLM's parsers ask for."""
    if fmt.needs_special_tokens and tools.parses_calls:
        return dataclasses.replace(options, skip_special_tokens=False)
    return options


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


class ResponseBuilder(Protocol):
    """Turns one Generation into SSE chunks or one response body (chat or completions)."""

    def events(self, include_usage: bool) -> AsyncIterator[str]: ...

    def response(self) -> Any: ...


async def respond(
    request: Request,
    client: EngineClient,
    group: RequestGroup,
    generation: Generation,
    builder: ResponseBuilder,
    stream: bool,
    include_usage: bool,
) -> Response:
    """Stream the generation as SSE, or run it to the end and answer once.

    Either way the group is released when the response ends, fails or the client leaves
    (a non-streaming client that disconnects gets a 499 that nobody reads).
    """
    if stream:
        return SSEResponse(builder.events(include_usage), lambda: client.release(group))
    try:
        await until_disconnected(request, generation.run())
        body = dump(builder.response())  # before the release: it may relabel finishes
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        client.release(group)
    return JSONResponse(body)


class GroupReleaseMiddleware:
    """ASGI middleware: each HTTP exchange runs inside `EngineClient.exchange()`, so a group
    that a route submitted is released when the exchange ends, however it ends.

    respond() releases its group first, as soon as the response is over; this catches a route
    that raises between submit() and respond(), whose group would otherwise stay registered
    (its engine requests running, and every later drain waiting out the grace period).
    """

    def __init__(self, app: ASGIApp, client: EngineClient) -> None:
        self.app = app
        self.client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.client.exchange():
            await self.app(scope, receive, send)
