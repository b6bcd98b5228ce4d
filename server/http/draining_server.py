"""DrainingServer: uvicorn, with SIGTERM meaning "drain, then exit" rather than "stop now".

On the first SIGTERM or SIGINT the server keeps listening but stops admitting (new requests
and /health get 503, so a load balancer routes elsewhere), waits for in-flight requests up
to the drain grace period, ends the rest with a 503 error, then shuts down and exits 0.
A second signal exits at once. If the model fails to load, the server exits with code 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from server.engine_client.client import EngineClient

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, client: EngineClient, grace_period: float) -> None:
        super().__init__(config)
        self.client = client
        self.grace_period = grace_period
        self.exit_code = 0
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only set flags; on_tick acts on them in the loop.
        # Signals are not re-raised after shutdown (unlike uvicorn's default), so the
        # process exits with our exit code instead of dying by the signal.
        if self._drain_requested or self.client.state in ("loading", "dead"):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            log.info("signal received: draining (grace period %.1f s)", self.grace_period)
            self._drain_task = asyncio.create_task(self._drain())
        if self.client.state == "dead" and not self.should_exit:
            log.error("engine is dead (%s); exiting", self.client.error)
            self.exit_code = 1
            self.should_exit = True
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        await self.client.drain(self.grace_period)
        log.info("drained; shutting down")
        self.should_exit = True
