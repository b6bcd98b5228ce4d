"""API-key authentication and tenant resolution: `Authorization: Bearer KEY`, compared in
constant time against every key (server/tenancy/tenants.py), and the optional trusted tenant header.

Applied as a router dependency to everything except /health and /metrics, which probes and
Prometheus must reach without a key, and the console's page and files (server/app.py lists
them; tests/unit/test_public_routes.py holds every other route to a 401 without a key). Every protected request leaves it with
`request.state.tenant` set to the `Tenant` it is billed to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request
from starlette.datastructures import Headers

from server.http.errors import OpenAIError
from server.tenancy.tenants import (
    DEFAULT_TENANT,
    Tenant,
    TenantDirectory,
    key_matches,  # noqa: F401 (re-exported: callers import it here)
    valid_tenant_name,
)

if TYPE_CHECKING:
    from server.settings import Settings

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def parse_bearer(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def bearer_token(request: Request) -> str | None:
    return parse_bearer(request.headers.get("authorization"))


def tenant_for(settings: Settings, headers: Headers) -> Tenant:
    """The tenant a request with these headers is billed to; raises 401 for a missing or
    unknown key (when keys are configured) and 400 for a malformed tenant header."""
    directory = settings.tenants
    tenant = _key_tenant(directory, headers.get("authorization"))
    named = _header_tenant(directory, headers)
    # With keys, the key already names a tenant: the gateway may only re-point it at another
    # configured one, so an unknown header name cannot invent tenants for key holders.
    if named is not None and (not directory.requires_auth or directory.is_configured(named.name)):
        return named
    return tenant


async def require_api_key(request: Request) -> None:
    request.state.tenant = tenant_for(request.app.state.settings, request.headers)


def _key_tenant(directory: TenantDirectory, authorization: str | None) -> Tenant:
    if not directory.requires_auth:
        return DEFAULT_TENANT
    token = parse_bearer(authorization)
    if token is None:
        raise OpenAIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers=dict(_CHALLENGE),
        )
    tenant = directory.resolve(token)
    if tenant is None:
        raise OpenAIError(
            401, "incorrect API key", code="invalid_api_key", headers=dict(_CHALLENGE)
        )
    return tenant


def _header_tenant(directory: TenantDirectory, headers: Headers) -> Tenant | None:
    """The tenant the trusted header names; None when the mode is off or the header absent."""
    if directory.tenant_header is None:
        return None  # the header is ignored entirely: clients must not pick their tenant
    values = headers.getlist(directory.tenant_header)
    if not values:
        return None
    if len(values) > 1 or not valid_tenant_name(values[0]):
        raise OpenAIError(
            400,
            f"invalid {directory.tenant_header} header: send one tenant name of 1-64 "
            "characters of A-Z a-z 0-9 _ . -",
            code="invalid_tenant",
        )
    return directory.named(values[0])
