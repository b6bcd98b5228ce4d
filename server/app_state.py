"""What route handlers take from app.state and the HTTP request: settings, the engine client
(503 until it is ready), served model names, the request's billing account and prefix-cache
salt, the tool-call format, memoized token texts; and ids and timestamps for responses."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from fastapi import Request

from engine.meter.billing import Prices
from server.engine_client.client import EngineClient
from server.engine_client.request_group import BillingAccount
from server.http.errors import OpenAIError
from server.settings import Settings
from server.tenancy.cache_salt import cache_salt
from server.tenancy.tenants import DEFAULT_TENANT_NAME
from server.text.detokenizer import TokenTexts
from server.tool_calls import FunctionTool, ToolCallFormat, tool_call_format


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
