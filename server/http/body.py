"""Reading a JSON request body: size limit (413), UTF-8 (400), JSON (400), schema (400).

Routes parse bodies here rather than through FastAPI's body parameters so each failure gets
its own clear OpenAI error, and an oversized body is refused before it is read whole.
JSON that Python's parser cannot take (nesting past MAX_DEPTH), the non-standard literals
NaN / Infinity, and integers outside 64 bits are 400s here, before any field sees them: no
field of the API needs them, and further in they would reach torch (a seed, a token id) and
fail there.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.http.errors import OpenAIError, bad_request, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)

# Bodies up to this size are parsed on the event loop (well under a millisecond); a hop to a
# worker thread would cost a small request more than parsing it.
INLINE_PARSE_BYTES = 64 * 1024
MAX_DEPTH = 64  # nesting of objects and arrays; OpenAI requests need < 10
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1  # a seed may use the unsigned range


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
    _check_depth(text)
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
            code="invalid_json",
        ) from None
    _check_integers(data, "")
    return data


# A JSON string, unrolled (runs of plain characters, then one escape) so that the regex engine
# takes a run in one step instead of one alternation per character.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH before parsing (the parser would recurse into it
    and, past the interpreter's limit, raise RecursionError). Strings (escapes included) and
    everything but brackets are dropped by regex first, so only brackets are walked."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if len(brackets) <= MAX_DEPTH:
        return
    depth = 0
    for char in brackets:
        depth += 1 if char in "[{" else -1
        if depth > MAX_DEPTH:
            raise bad_request(
                f"request body nests objects/arrays deeper than {MAX_DEPTH} levels",
                code="invalid_json",
            )


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise bad_request(
            f"request body has the number {literal[:40]}, outside the range of a float",
            code="invalid_json",
        )
    return value


def _refuse_constant(name: str) -> float:
    raise bad_request(
        f"request body is not valid JSON: {name} is not a JSON number", code="invalid_json"
    )


def _check_integers(value: object, path: str) -> None:
    """Every integer in the body fits 64 bits (iteratively bounded by MAX_DEPTH already)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= UINT64_MAX:
            field = path.lstrip(".").split(".")[0].split("[")[0] or None
            raise bad_request(
                f"{path.lstrip('.') or 'value'}: integer {value} is outside the 64-bit range",
                param=field,
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_integers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_integers(item, f"{path}[{index}]")


async def parse_request(request: Request, model: type[ModelT], max_bytes: int) -> ModelT:
    """The body as `model`, checked (every failure an OpenAIError). A large body is parsed
    and validated in a worker thread: a 4 MiB body costs ~100 ms of parsing, a whole
    vocabulary of logit_bias ~50 ms of validating, which on the event loop would pause every
    other client's stream (the loop still gets the GIL at every switch interval meanwhile)."""
    raw = await read_body(request, max_bytes)
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_body(raw, model)
    return await asyncio.to_thread(parse_body, raw, model)


def parse_body(raw: bytes, model: type[ModelT]) -> ModelT:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(data).__name__}",
            code="invalid_json",
        )
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    check_fields = getattr(parsed, "check_fields", None)
    if check_fields is not None:
        check_fields()
    return parsed


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(
        413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large"
    )
