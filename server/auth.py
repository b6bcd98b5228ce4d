"""API-key authentication: `Authorization: Bearer KEY`, compared in constant time.

Applied as a router dependency to everything except /health and /metrics, which probes and
Prometheus must reach without a key.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import OpenAIError


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """True when `presented` equals one of `keys`. Every key is compared (no early exit), each
    with hmac.compare_digest, so timing reveals neither which key nor how much matched."""
    candidate = presented.encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, key.encode("utf-8"))
    return matched


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def require_api_key(request: Request) -> None:
    keys: tuple[str, ...] = request.app.state.settings.api_keys
    if not keys:
        return
    token = bearer_token(request)
    if token is None:
        raise OpenAIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not key_matches(token, keys):
        raise OpenAIError(
            401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
