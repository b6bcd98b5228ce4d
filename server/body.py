"""Reading a JSON request body: size limit (413), UTF-8 (400), JSON (400), schema (400).

Routes parse bodies here rather than through FastAPI's body parameters so each failure gets
its own clear OpenAI error, and an oversized body is refused before it is read whole.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.errors import OpenAIError, bad_request, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})",
            code="invalid_utf8",
        ) from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
            code="invalid_json",
        ) from None


async def parse_request(request: Request, model: type[ModelT], max_bytes: int) -> ModelT:
    data = parse_json(await read_body(request, max_bytes))
    if not isinstance(data, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(data).__name__}",
            code="invalid_json",
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(
        413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large"
    )
