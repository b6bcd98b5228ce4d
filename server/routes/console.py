"""GET /: the web console, a single page shipped inside the package (server/console/).

Public, like /health: the page holds no data, and its API calls send the key the user gives
it. The Content-Security-Policy lets the page load and fetch from this origin only, so
nothing it does can leave the server's origin (docs/console.md).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.http.errors import OpenAIError

router = APIRouter()

_FILES = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files("server.console").joinpath(name).read_bytes()


@router.get("/", include_in_schema=False)
async def console_page() -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.get("/console/config.json", include_in_schema=False)
async def console_config(request: Request) -> dict[str, bool]:
    """What the page must know before its first API call: whether to ask for a key (a 401
    would tell as much; asking first keeps the browser's console free of failed requests)."""
    return {"requires_api_key": request.app.state.settings.tenants.requires_auth}


@router.get("/console/{name}", include_in_schema=False)
async def console_asset(name: str) -> Response:
    media_type = _FILES.get(name)
    if media_type is None:
        raise OpenAIError(404, f"no console file {name!r}", code="not_found")
    return Response(_read(name), media_type=media_type, headers=_HEADERS)
