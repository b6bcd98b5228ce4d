"""GET /openapi.json: the API's OpenAPI document (built by server/http/openapi.py).

Behind the API key, like the routes it describes: it names the server's version, which
/version keeps behind the key too. There is no Swagger UI or ReDoc page (FastAPI's /docs and
/redoc): both load their scripts from a CDN, and this origin is the web console's, which keeps
the user's API key in session storage (docs/api.md).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/openapi.json", include_in_schema=False)
async def openapi_document(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())
