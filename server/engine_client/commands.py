"""The commands the asyncio loop sends the engine thread: one way, over one queue.SimpleQueue.

This is the whole loop -> thread interface (server/engine_client/client.py puts,
server/engine_client/loop.py takes). The other direction is `loop.call_soon_threadsafe` of the
thread's event batches and of its ready/dead reports. Commands hold plain fields only, so they could
cross a process boundary later; a Snapshot's future is the one exception, answered by the thread.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from server.engine_client.request_group import EngineRequestSpec


@dataclass(frozen=True, slots=True)
class Add:
    """Admit one engine request (one choice of one prompt)."""

    spec: EngineRequestSpec
    arrival_time: float  # time.monotonic() when the HTTP request was admitted
    tenant: str = ""  # the billing account's tenant label: admission takes turns by it


@dataclass(frozen=True, slots=True)
class Abort:
    """End one engine request early; its final event still comes back (for the bill)."""

    request_id: str
    error: str | None = None
    stopped: bool = False  # a stop string matched: the request finishes as "stop"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Answer engine facts (blocks, queue, invariants) on `future`, unless it was cancelled
    (the loop side gave up waiting)."""

    future: concurrent.futures.Future[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Stop:
    """Abort everything unfinished and end the thread."""

    reason: str


Command = Add | Abort | Snapshot | Stop
