"""Server-sent events: `data: {json}` chunks, an error event, `data: [DONE]`.

`SSEResponse` guarantees its `on_close` callback runs however the stream ends (finished,
failed, or the client disconnected before or during the stream), which is what aborts the
engine requests and frees their blocks. Errors after the first byte cannot change the HTTP
status any more, so they are sent as one `data: {"error": {...}}` event before [DONE].
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.http.errors import OpenAIError

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def with_error_event(events: AsyncIterator[str], done: bool = True) -> AsyncIterator[str]:
    """Pass events through; an OpenAIError (or any failure) becomes an error event. [DONE]
    last, unless `done` is false (the Responses API's stream ends without it)."""
    try:
        async for event in events:
            yield event
    except OpenAIError as exc:
        yield sse_event(exc.body())
    except Exception as exc:
        log.exception("stream failed")
        yield sse_event(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").body())
    if done:
        yield DONE


class SSEResponse(StreamingResponse):
    """A text/event-stream response whose on_close runs exactly when the exchange is over."""

    def __init__(
        self, events: AsyncIterator[str], on_close: Callable[[], None], done: bool = True
    ) -> None:
        super().__init__(
            with_error_event(events, done),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()
