"""An HTTP exchange's request groups: every group a route submits while handling one HTTP
request is released when that exchange ends, however it ends.

The serving core (server/openai/serving_core.py) releases its group first, as soon as the response
is over; `GroupReleaseMiddleware` is the backstop for a route that raises between submit() and the
response, whose group would otherwise stay registered (its engine requests running, and every later
drain waiting out the grace period). release() is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from server.engine_client.request_group import RequestGroup

if TYPE_CHECKING:
    from server.engine_client.client import EngineClient

# The groups submitted in the current exchange (per asyncio task; None outside exchange()).
_exchange_groups: ContextVar[list[RequestGroup] | None] = ContextVar(
    "meterserve_exchange_groups", default=None
)


def track(group: RequestGroup) -> None:
    """`group` was submitted: release it when the current exchange ends (if inside one)."""
    groups = _exchange_groups.get()
    if groups is not None:
        groups.append(group)


@contextmanager
def exchange(release: Callable[[RequestGroup], None]) -> Iterator[None]:
    """One HTTP exchange: every group submitted inside it is `release`d when it ends."""
    groups: list[RequestGroup] = []
    token = _exchange_groups.set(groups)
    try:
        yield
    finally:
        _exchange_groups.reset(token)
        for group in groups:
            release(group)


class GroupReleaseMiddleware:
    """ASGI middleware: each HTTP exchange runs inside `exchange(client.release)`."""

    def __init__(self, app: ASGIApp, client: EngineClient) -> None:
        self.app = app
        self.client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with exchange(self.client.release):
            await self.app(scope, receive, send)
