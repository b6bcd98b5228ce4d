"""OpenAI-format errors: one exception type, its JSON body, and the app's exception handlers.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with the
HTTP status that says what went wrong (400 bad input, 401 auth, 404 unknown model or route,
413 oversized body, 429 overload, 503 loading/draining, 500 engine failure).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# OpenAI's error `type` per status; anything unlisted is a server error.
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error that becomes one OpenAI error response (or one SSE error event)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """The first pydantic error as a 400 naming the offending field (dotted path)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    # FastAPI prefixes locations with "body"; pydantic unions add the tried member's type name.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return bad_request(message, param=param.split(".")[0] if param else None)


async def _openai_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    _observe(request, exc)
    return exc.response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, (RequestValidationError, ValidationError))
    error = validation_error(exc)
    _observe(request, error)
    return error.response()


def _observe(request: Request, error: OpenAIError) -> None:
    """Let the app count the rejection (app.state.observe_error, when the app sets one)."""
    observe = getattr(request.app.state, "observe_error", None)
    if observe is not None:
        observe(error)


async def _http_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    headers = dict(exc.headers) if exc.headers else None
    return OpenAIError(exc.status_code, message, headers=headers).response()


async def _unhandled_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
