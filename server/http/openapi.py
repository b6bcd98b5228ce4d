"""The OpenAPI document's request bodies for the routes that parse their own JSON.

Generation routes read their bodies through server/http/body.py (so each failure gets its own
OpenAI error) instead of FastAPI body parameters, which leaves FastAPI's generated document
without request bodies. This adds them from the same pydantic models, so /openapi.json
describes what the server accepts (clients, schemathesis).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make app.openapi() describe `bodies` ({POST path: request model})."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                    },
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
