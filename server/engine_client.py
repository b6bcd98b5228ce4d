"""EngineClient: the engine thread, its command queue, and the per-request event queues.

The engine (EngineCore) is single-threaded by contract, so one thread owns it: it loads the
model, then loops: take commands (add, abort, snapshot, stop) -> step() -> hand the step's
token events to the asyncio loop in one `call_soon_threadsafe`. On the loop side every HTTP
request owns a `RequestGroup` (server/request_group.py: its n engine requests and one
asyncio.Queue); the dispatcher routes each event to its group. Releasing a group aborts
whatever of it is unfinished, so a disconnect, a timeout or an error frees the engine's
blocks the same way; a stop string finishes its engine request as stopped. A released group
is settled (its bill booked once) when its last final event arrives.
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
from server.admission import Admission
from server.errors import OpenAIError
from server.request_group import (
    FAILED,
    BillingAccount,
    EngineRequestSpec,
    RequestGroup,
    Settlement,
)

log = logging.getLogger(__name__)

_STALL_WAIT_S = 0.005
MetricsFactory = Callable[[Any], Any]  # EngineCore -> ServerMetrics (built on the engine thread)


@dataclass(frozen=True, slots=True)
class _Add:
    spec: EngineRequestSpec
    arrival_time: float


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str
    error: str | None = None
    stopped: bool = False  # a stop string matched: the request finishes as "stop"


@dataclass(frozen=True, slots=True)
class _Snapshot:
    future: concurrent.futures.Future


@dataclass(frozen=True, slots=True)
class _Stop:
    reason: str


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
        metrics_factory: MetricsFactory | None = None,
    ) -> None:
        self._engine_config = engine_config
        self.meter_config = meter_config if meter_config is not None else MeterConfig()
        self._request_timeout = request_timeout
        self._metrics_factory = metrics_factory
        self._admission = Admission(max_waiting_requests, max_queued_tokens)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # request_id -> group, choice
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

    # ---------------------------------------------------------------- lifecycle (loop side)

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
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, ending every unfinished request."""
        self._fail_all(OpenAIError(503, "server is shutting down", code="server_shutdown"))
        if self._thread is None or not self._thread.is_alive():
            return
        self._commands.put(_Stop("server shut down"))
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

    # ------------------------------------------------------------------ requests (loop side)

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
        self._groups.add(group)
        self._idle.clear()
        for index, spec in enumerate(specs):
            self._routes[spec.request_id] = (group, index)
            self._admission.enter(len(spec.prompt_token_ids))
            self._commands.put(_Add(spec, now))
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
            self._commands.put(_Abort(request_id, stopped=True))

    def deliver(self, group: RequestGroup, index: int, num_tokens: int) -> None:
        """num_tokens more output tokens of choice `index` went into the response."""
        if num_tokens:
            group.delivered[index] += num_tokens
            if self.metrics is not None:
                _safely(self.metrics.observe_delivered, group.account.tenant, num_tokens)

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
                self._commands.put(_Abort(request_id))
        self._groups.discard(group)
        if not self._groups:
            self._idle.set()
        self._settle_if_complete(group)

    def observe_rejection(self, reason: str) -> None:
        self._observe_rejection(reason)

    async def debug_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "state": self.state,
            "error": self.error,
            "num_in_flight_http_requests": len(self._groups),
            "num_queued": self._admission.num_queued,
            "queued_tokens": self._admission.queued_tokens,
        }
        if self.state in ("loading", "dead") or not self._thread or not self._thread.is_alive():
            return info
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Snapshot(future))
        info.update(await asyncio.wrap_future(future))
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

    def _dispatch(self, events: list[TokenEvent]) -> None:
        """Loop side: route one step's events to their groups' queues (a released group only
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
            _safely(self.metrics.observe_settlement, settlement)

    def _fail_all(self, error: OpenAIError) -> None:
        for group in list(self._groups):
            group.end_reason = FAILED
            group.queue.put_nowait(error)

    def _on_ready(self, core: Any, metrics: Any) -> None:
        self.tokenizer = core.tokenizer
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.kv_cache_info = core.kv_cache_info
        self.max_request_tokens = min(core.max_model_len, core.kv_cache_info.max_tokens)
        # Token ids index the model's embedding; the tokenizer may know fewer or more ids.
        self.vocab_size = _model_vocab_size(core) or len(core.tokenizer)
        self.metrics = metrics
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def _on_dead(self, error: str) -> None:
        self.error = error
        self._fail_all(OpenAIError(500, f"engine failure: {error}", code="engine_dead"))
        for route_group, _ in list(self._routes.values()):
            self._settle_if_complete(route_group)  # released ones: no final event will come

    def _observe_rejection(self, reason: str) -> None:
        if self.metrics is not None:
            _safely(self.metrics.observe_rejection, reason)

    # ------------------------------------------------------------------ engine thread side

    def _call_loop(self, fn: Callable, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop has closed: nobody is waiting any more

    def _thread_main(self) -> None:
        try:
            from engine.core import EngineCore  # heavy (torch); only the engine thread needs it

            core = EngineCore(self._engine_config, self.meter_config)
            metrics = self._metrics_factory(core) if self._metrics_factory else None
        except Exception as exc:  # noqa: BLE001 - any load failure is reported, not raised
            log.error("model failed to load: %s", exc)
            self._call_loop(self._on_dead, f"model failed to load: {_one_line(exc)}")
            return
        self._call_loop(self._on_ready, core, metrics)
        try:
            _EngineLoop(core, metrics, self._commands, self._call_loop, self._dispatch).run()
        except Exception as exc:
            log.exception("engine loop crashed")
            self._call_loop(self._on_dead, f"engine loop crashed: {_one_line(exc)}")


class _EngineLoop:
    """The engine thread's loop. Every EngineCore call in the server happens in here."""

    def __init__(self, core, metrics, commands, call_loop, dispatch) -> None:
        self.core = core
        self.metrics = metrics
        self.commands: queue.SimpleQueue = commands
        self.call_loop = call_loop
        self.dispatch = dispatch
        self.live: set[str] = set()  # request ids the core holds unfinished
        self.stalled = False  # the last step scheduled nothing although requests wait

    def run(self) -> None:
        core = self.core
        while True:
            events: list[TokenEvent] = []
            snapshots: list[_Snapshot] = []
            for command in self._take_commands(self._wait_s()):
                if isinstance(command, _Stop):
                    self._abort_all(command.reason)
                    return
                if isinstance(command, _Snapshot):
                    snapshots.append(command)
                else:
                    events.extend(self._apply(command))
            if core.has_unfinished_requests():
                events.extend(self._step())
            self._observe(events)
            if events:
                self.call_loop(self.dispatch, events)
            # Answered last, so a snapshot also covers the metrics of everything before it.
            for snapshot in snapshots:
                snapshot.future.set_result(self._snapshot())

    def _observe(self, events: list[TokenEvent]) -> None:
        if self.metrics is None:
            return
        for event in events:
            _safely(self.metrics.observe_event, event)
        core = self.core
        _safely(
            self.metrics.set_queue_state, core.num_waiting, core.num_running, core.kv_cache_usage
        )

    def _wait_s(self) -> float | None:
        """How long to wait for a command: forever when idle, not at all while requests run,
        briefly when the last step could schedule nothing (so the thread does not spin)."""
        if not self.core.has_unfinished_requests():
            return None
        return _STALL_WAIT_S if self.stalled else 0.0

    def _take_commands(self, wait_s: float | None) -> list:
        commands = []
        if wait_s is None or wait_s > 0:
            try:
                commands.append(self.commands.get(timeout=wait_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command) -> list[TokenEvent]:
        if isinstance(command, _Add):
            spec = command.spec
            try:
                self.core.add_request(
                    spec.request_id,
                    spec.prompt_token_ids,
                    spec.params,
                    arrival_time=command.arrival_time,
                )
            except Exception as exc:  # noqa: BLE001 - the route pre-checks; this is a backstop
                why = f"request rejected by the engine: {_one_line(exc)}"
                return [_error_event(spec, why, command.arrival_time)]
            self.live.add(spec.request_id)
            return []
        if isinstance(command, _Abort):
            self.live.discard(command.request_id)
            if command.stopped:
                event = self.core.stop_request(command.request_id)
            else:
                event = self.core.abort_request(command.request_id, command.error)
            return [event] if event is not None else []
        return []

    def _step(self) -> list[TokenEvent]:
        try:
            result = self.core.step()
        except Exception as exc:
            log.exception("engine step raised; failing %d in-flight request(s)", len(self.live))
            return self._abort_all(f"engine step failed: {_one_line(exc)}")
        self.stalled = result.stats is None
        for event in result.events:
            if event.finished:
                self.live.discard(event.request_id)
        if result.stats is not None and self.metrics is not None:
            _safely(self.metrics.observe_step, result.stats)
        return result.events

    def _abort_all(self, error: str) -> list[TokenEvent]:
        events = []
        for request_id in list(self.live):
            event = self.core.abort_request(request_id, error)
            if event is not None:
                events.append(event)
        self.live.clear()
        self.core.check_invariants()  # raising here kills the loop: the engine is then dead
        return events

    def _snapshot(self) -> dict[str, Any]:
        core = self.core
        try:
            core.check_invariants()
            invariants_ok, invariants_error = True, None
        except Exception as exc:  # noqa: BLE001
            invariants_ok, invariants_error = False, _one_line(exc)
        return {
            "num_waiting": core.num_waiting,
            "num_running": core.num_running,
            "num_free_blocks": core.num_free_blocks,
            "num_blocks": core.kv_cache_info.num_blocks,
            "block_size": core.kv_cache_info.block_size,
            "kv_cache_usage": core.kv_cache_usage,
            "max_running_batch_observed": core.max_running_batch_observed,
            "preemptions": core.num_preemptions_total,
            "invariants_ok": invariants_ok,
            "invariants_error": invariants_error,
        }


def _error_event(spec: EngineRequestSpec, error: str, arrival_time: float) -> TokenEvent:
    return TokenEvent(
        request_id=spec.request_id,
        new_token_ids=[],
        finish_reason="error",
        error=error,
        num_prompt_tokens=len(spec.prompt_token_ids),
        arrival_time=arrival_time,
    )


def _model_vocab_size(core: Any) -> int:
    shape = getattr(core, "model_shape", None)
    return int(getattr(shape, "vocab_size", 0) or 0)


def _safely(fn: Callable, *args: Any) -> None:
    """Metrics must never take the engine down: a failing hook is logged, not raised."""
    try:
        fn(*args)
    except Exception:
        log.exception("metrics hook %s failed", getattr(fn, "__qualname__", fn))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
