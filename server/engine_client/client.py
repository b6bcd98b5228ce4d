"""EngineClient: the asyncio-loop side of the engine: admission, request groups, routing.

Everything here runs on the event loop. The engine thread (server/engine_client/loop.py) is reached
only through its command queue (server/engine_client/commands.py: Add, Abort, Snapshot, Stop); it
answers only through `call_soon_threadsafe` of one iteration's token events (`_dispatch`) and of its
ready/dead reports (`_on_ready`, `_on_dead`).

Every HTTP request owns a `RequestGroup` (server/engine_client/request_group.py: its n engine
requests and one asyncio.Queue); the dispatcher routes each event to its group. Releasing a group
aborts whatever of it is unfinished, so a disconnect, a timeout or an error frees the engine's
blocks the same way; a stop string finishes its engine request as stopped. A released group is
settled (its bill booked once) when its last final event arrives. A group submitted inside an HTTP
exchange (server/engine_client/exchange.py) is released when the exchange ends, even if the route
raised before it handed the group to its response.

Liveness (`liveness()`, read by /health): the engine is dead when its thread has ended or
reported a failure, and stalled when requests are pending and the thread has not finished an
iteration for `stall_timeout` seconds (a wedged native call, a deadlock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.meter.config import MeterConfig
from scheduler.output import TokenEvent
from server.engine_client.admission import Admission
from server.engine_client.commands import Abort, Add, Command, Snapshot, Stop
from server.engine_client.exchange import track
from server.engine_client.loop import EngineLoop, LoopSide, MetricsFactory, safely
from server.engine_client.request_group import (
    FAILED,
    BillingAccount,
    EngineRequestSpec,
    RequestGroup,
    Settlement,
)
from server.http.errors import OpenAIError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineLiveness:
    """Is the engine thread alive and making progress (what a liveness probe asks)."""

    dead: bool  # the thread has ended, crashed or failed to load
    stalled: bool  # requests are pending and no iteration finished for stall_timeout seconds
    seconds_since_step: float  # since the last iteration finished (or the pending work came)
    num_pending: int  # engine requests sent to the thread whose final event is not back


class EngineClient:
    """Owns the engine thread; admits, routes and aborts requests for the HTTP handlers."""

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        meter_config: MeterConfig | None = None,
        max_waiting_requests: int,
        max_queued_tokens: int,
        request_timeout: float | None,
        stall_timeout: float | None = None,
        metrics_factory: MetricsFactory | None = None,
    ) -> None:
        self._engine_config = engine_config
        self.meter_config = meter_config if meter_config is not None else MeterConfig()
        self._request_timeout = request_timeout
        self._stall_timeout = stall_timeout  # None: never report a stall
        self._metrics_factory = metrics_factory
        self._admission = Admission(max_waiting_requests, max_queued_tokens)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._engine: EngineLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False  # shutdown() ended the thread on purpose
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # request_id -> group, choice
        self._busy_since = 0.0  # time.monotonic() when _routes last became non-empty
        self._groups: set[RequestGroup] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._ready = asyncio.Event()
        self.error: str | None = None  # why the engine is dead (load failure or crash)
        self.metrics: Any = None
        self.on_ready: Callable[[], None] | None = None
        # Facts published once the model has loaded.
        self.tokenizer: Any = None
        self.model_name = ""
        self.max_model_len = 0
        self.max_request_tokens = 0  # prompt + max_tokens that one request may use
        self.vocab_size = 0
        self.kv_cache_info: Any = None
        self.structured: Any = None  # the engine's StructuredOutputs: grammars compile ahead

    # ---------------------------------------------------------------------------- lifecycle

    @property
    def state(self) -> str:
        if self.error is not None:
            return "dead"
        if not self._ready.is_set():
            return "loading"
        return "draining" if self._draining else "ready"

    @property
    def num_in_flight(self) -> int:
        return len(self._groups)

    @property
    def admission(self) -> Admission:
        return self._admission

    def start(self) -> None:
        """Start the engine thread (it loads the model). Call from the running event loop."""
        side = LoopSide(asyncio.get_running_loop(), self._on_ready, self._on_dead, self._dispatch)
        self._engine = EngineLoop(
            self._engine_config, self.meter_config, self._metrics_factory, self._commands, side
        )
        self._thread = threading.Thread(target=self._engine.run, name="engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, ending every unfinished request."""
        self._fail_all(OpenAIError(503, "server is shutting down", code="server_shutdown"))
        if self._thread is None or not self._thread.is_alive():
            return
        self._stopping = True
        self._commands.put(Stop("server shut down"))
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.0f s", timeout)

    def start_draining(self) -> None:
        self._draining = True

    async def drain(self, grace_period: float) -> None:
        """Stop admitting; wait for in-flight requests up to grace_period, then end the rest."""
        self.start_draining()
        try:
            async with asyncio.timeout(grace_period):
                await self._idle.wait()
            return
        except TimeoutError:
            pass
        log.warning("drain grace period elapsed; ending %d request(s)", len(self._groups))
        self._fail_all(
            OpenAIError(
                503,
                f"server is shutting down: the drain grace period of {grace_period:g} s elapsed",
                code="server_shutdown",
            )
        )
        try:
            async with asyncio.timeout(5.0):
                await self._idle.wait()
        except TimeoutError:
            log.warning("%d request(s) did not end after the drain", len(self._groups))

    def liveness(self) -> EngineLiveness:
        """Dead or stalled, measured now. The stall clock starts at the later of the thread's
        last heartbeat and the moment work became pending (an idle thread beats no more)."""
        now = time.monotonic()
        thread = self._thread
        ended = thread is not None and not thread.is_alive() and not self._stopping
        dead = self.error is not None or ended
        heartbeat = self._engine.heartbeat if self._engine is not None else now
        since = max(0.0, now - max(heartbeat, self._busy_since))
        num_pending = len(self._routes)
        timeout = self._stall_timeout
        stalled = not dead and num_pending > 0 and timeout is not None and since > timeout
        return EngineLiveness(dead, stalled, since, num_pending)

    # ------------------------------------------------------------------------------ requests

    def submit(
        self, specs: list[EngineRequestSpec], account: BillingAccount | None = None
    ) -> RequestGroup:
        """Admit a group of engine requests or raise 429/503 OpenAIError."""
        self._check_accepting()
        now = time.monotonic()
        num_tokens = sum(len(spec.prompt_token_ids) for spec in specs)
        rejection = self._admission.check(len(specs), num_tokens, now)
        if rejection is not None:
            self._observe_rejection(rejection.reason)
            raise OpenAIError(
                429,
                rejection.message,
                code=rejection.reason,
                headers={"Retry-After": str(rejection.retry_after_s)},
            )
        loop = asyncio.get_running_loop()
        deadline = None if self._request_timeout is None else loop.time() + self._request_timeout
        group = RequestGroup(
            specs,
            deadline,
            account if account is not None else self.default_account(),
            lambda: self._observe_rejection("timeout"),
        )
        track(group)  # released when the HTTP exchange ends, whatever the route does
        self._groups.add(group)
        self._idle.clear()
        if not self._routes:
            self._busy_since = now
        for index, spec in enumerate(specs):
            self._routes[spec.request_id] = (group, index)
            self._admission.enter(len(spec.prompt_token_ids))
            self._commands.put(Add(spec, now, group.account.tenant))
        return group

    def default_account(self, tenant: str = "default") -> BillingAccount:
        """The server's list prices, billed to `tenant`."""
        meter = self.meter_config
        return BillingAccount(tenant, meter.default_prices)

    def stop(self, group: RequestGroup, request_id: str) -> None:
        """A stop string matched: finish the engine request as stopped (its blocks are freed;
        its final event, with timings and cost, still reaches the group)."""
        if request_id in group.unfinished and request_id not in group.aborted:
            group.aborted.add(request_id)
            self._commands.put(Abort(request_id, stopped=True))

    def deliver(self, group: RequestGroup, index: int, num_tokens: int) -> None:
        """num_tokens more output tokens of choice `index` went into the response."""
        if num_tokens:
            group.delivered[index] += num_tokens
            if self.metrics is not None:
                safely(self.metrics.observe_delivered, group.account.tenant, num_tokens)

    def bill(self, group: RequestGroup):
        return group.bill(self.meter_config.hardware_price_per_second)

    def release(self, group: RequestGroup) -> None:
        """The HTTP request is over (done, failed, timed out or disconnected): abort what is
        unfinished. Its routes stay until the aborts are acknowledged, then it is settled."""
        if group.released:
            return
        group.released = True
        for request_id in list(group.unfinished):
            self._leave_queue(group, request_id, served=False)
            if request_id not in group.aborted:
                group.aborted.add(request_id)
                self._commands.put(Abort(request_id))
        self._groups.discard(group)
        if not self._groups:
            self._idle.set()
        self._settle_if_complete(group)

    def observe_rejection(self, reason: str) -> None:
        self._observe_rejection(reason)

    async def debug_info(self, timeout: float) -> dict[str, Any]:
        """Loop-side facts plus the engine thread's snapshot; 503 OpenAIError when the thread
        does not answer within `timeout` seconds (a long step, or a wedged one)."""
        info: dict[str, Any] = {
            "state": self.state,
            "error": self.error,
            "num_in_flight_http_requests": len(self._groups),
            "num_queued": self._admission.num_queued,
            "queued_tokens": self._admission.queued_tokens,
        }
        if self.state in ("loading", "dead") or not self._thread or not self._thread.is_alive():
            return info
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._commands.put(Snapshot(future))
        try:
            async with asyncio.timeout(timeout):
                info.update(await asyncio.wrap_future(future))
        except TimeoutError:
            future.cancel()  # the thread drops a cancelled snapshot unanswered
            raise OpenAIError(
                503,
                f"the engine did not answer within {timeout:g} s: its thread is busy or "
                "wedged (see /health)",
                code="engine_unresponsive",
            ) from None
        return info

    def _check_accepting(self) -> None:
        state = self.state
        if state == "ready":
            return
        reason = {
            "loading": "the model is still loading",
            "draining": "the server is shutting down",
            "dead": f"the engine is not running: {self.error}",
        }[state]
        if state == "draining":
            self._observe_rejection("draining")
        raise OpenAIError(503, f"service unavailable: {reason}", code=f"server_{state}")

    def _leave_queue(self, group: RequestGroup, request_id: str, served: bool) -> None:
        """served: it left the queue with a first token (what Retry-After's rate counts)."""
        if request_id in group.queued:
            group.queued.discard(request_id)
            spec = group.specs[group.index[request_id]]
            self._admission.leave(len(spec.prompt_token_ids), time.monotonic(), served)

    def _settle_if_complete(self, group: RequestGroup) -> None:
        """Book a released group's bill once, when every final event is in (or at once when
        the engine is dead and none will come)."""
        if group.settled or not group.released or not (group.complete or self.error):
            return
        group.settled = True
        for request_id in group.unfinished:
            self._routes.pop(request_id, None)
        settlement: Settlement = group.settlement(self.meter_config.hardware_price_per_second)
        if self.metrics is not None:
            safely(self.metrics.observe_settlement, settlement)

    def _fail_all(self, error: OpenAIError) -> None:
        for group in list(self._groups):
            group.end_reason = FAILED
            group.queue.put_nowait(error)

    def _observe_rejection(self, reason: str) -> None:
        if self.metrics is not None:
            safely(self.metrics.observe_rejection, reason)

    # ------------------------------------------- what the engine thread posts (call_soon_threadsafe)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        """Route one iteration's events to their groups' queues (a released group only
        collects its final events, for its settlement)."""
        for event in events:
            route = self._routes.get(event.request_id)
            if route is None:
                continue  # not ours (any more)
            group, index = route
            if event.new_token_ids or event.finished:
                self._leave_queue(group, event.request_id, served=bool(event.new_token_ids))
            if event.finished:
                group.unfinished.discard(event.request_id)
                group.final_events[index] = event
                del self._routes[event.request_id]
            if group.released:
                self._settle_if_complete(group)
            else:
                group.queue.put_nowait((index, event))

    def _on_ready(self, core: Any, metrics: Any) -> None:
        self.tokenizer = core.tokenizer
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.kv_cache_info = core.kv_cache_info
        # The core says what one request can hold (a sliding window lifts the KV cap); fakes
        # give only the context and the cache.
        self.max_request_tokens = getattr(core, "max_request_tokens", None) or min(
            core.max_model_len, core.kv_cache_info.max_tokens
        )
        # Token ids index the model's embedding; the tokenizer may know fewer or more ids.
        self.vocab_size = _model_vocab_size(core) or len(core.tokenizer)
        self.structured = getattr(getattr(core, "runner", None), "structured", None)  # fakes: None
        self.metrics = metrics
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def _on_dead(self, error: str) -> None:
        self.error = error
        self._fail_all(OpenAIError(500, f"engine failure: {error}", code="engine_dead"))
        for route_group, _ in list(self._routes.values()):
            self._settle_if_complete(route_group)  # released ones: no final event will come


def _model_vocab_size(core: Any) -> int:
    shape = getattr(core, "model_shape", None)
    return int(getattr(shape, "vocab_size", 0) or 0)
