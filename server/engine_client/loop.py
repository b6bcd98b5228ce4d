"""EngineLoop: the engine thread. Every EngineCore call in the server happens on it.

The engine (EngineCore) is single-threaded by contract, so one thread owns it. It loads the
model, then loops: take commands -> step() -> hand the iteration's token events to the asyncio
loop in one `call_soon_threadsafe`. Nothing else crosses between the two sides:

    asyncio loop (engine_client/client.py)            engine thread (this module)
      Add / Abort / Snapshot / Stop   ── queue.SimpleQueue ──▶  (engine_client/commands.py)
      dispatch(events), on_ready, on_dead  ◀── call_soon_threadsafe ──

Liveness: after every iteration the thread writes `heartbeat` (time.monotonic(); a plain float
attribute, read by the loop side without a lock), so the loop side can tell a wedged step from
a busy one. However the thread ends other than by a Stop command (a load failure, a crash, even
a BaseException), the loop side is told that the engine died.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.meter.config import MeterConfig
from scheduler.output import TokenEvent
from server.engine_client.commands import Abort, Add, Command, Snapshot, Stop
from server.engine_client.request_group import EngineRequestSpec

log = logging.getLogger(__name__)

# How long to wait for a command when the last step could schedule nothing (so the thread
# does not spin while requests wait for blocks).
_NOTHING_SCHEDULED_WAIT_S = 0.005
MetricsFactory = Callable[[Any], Any]  # EngineCore -> ServerMetrics (built on the engine thread)


@dataclass(frozen=True, slots=True)
class LoopSide:
    """What the engine thread reports to the asyncio loop, always via call_soon_threadsafe."""

    loop: asyncio.AbstractEventLoop
    on_ready: Callable[[Any, Any], None]  # (EngineCore, metrics): the model has loaded
    on_dead: Callable[[str], None]  # why the engine stopped serving
    dispatch: Callable[[list[TokenEvent]], None]  # one iteration's token events, in order

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop has closed: nobody is waiting any more


class EngineLoop:
    """The engine thread's body: loads the model, then applies commands and steps until Stop.

    Owns the EngineCore and the request ids it holds unfinished (`live`). Guarantees: events
    reach the loop side in the order the core produced them; a Snapshot is answered after the
    events of its iteration; `heartbeat` advances after every iteration.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        meter_config: MeterConfig,
        metrics_factory: MetricsFactory | None,
        commands: queue.SimpleQueue[Command],
        side: LoopSide,
    ) -> None:
        self._engine_config = engine_config
        self._meter_config = meter_config
        self._metrics_factory = metrics_factory
        self.commands = commands
        self.side = side
        self.core: Any = None  # the EngineCore, once loaded
        self.metrics: Any = None
        self.live: set[str] = set()  # request ids the core holds unfinished
        self.scheduled_nothing = False  # the last step scheduled nothing although requests wait
        self.heartbeat = time.monotonic()  # when the thread last finished an iteration

    def run(self) -> None:
        """The thread's target."""
        side = self.side
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - any load failure is reported, not raised
            log.error("model failed to load: %s", exc)
            side.post(side.on_dead, f"model failed to load: {one_line(exc)}")
            return
        side.post(side.on_ready, self.core, self.metrics)
        try:
            self._serve()
        except BaseException as exc:
            log.exception("engine loop crashed")
            side.post(side.on_dead, f"engine loop crashed: {one_line(exc)}")

    def _load(self) -> None:
        from engine.core import EngineCore  # heavy (torch); only the engine thread needs it

        self.core = EngineCore(self._engine_config, self._meter_config)
        self.metrics = self._metrics_factory(self.core) if self._metrics_factory else None

    def _serve(self) -> None:
        core = self.core
        while True:
            events: list[TokenEvent] = []
            snapshots: list[Snapshot] = []
            for command in self._take_commands(self._wait_s()):
                if isinstance(command, Stop):
                    self._abort_all(command.reason)
                    return
                if isinstance(command, Snapshot):
                    snapshots.append(command)
                else:
                    events.extend(self._apply(command))
            if core.has_unfinished_requests():
                events.extend(self._step())
            self._observe(events)
            if events:
                self.side.post(self.side.dispatch, events)
            # Answered last, so a snapshot also covers the metrics of everything before it.
            for snapshot in snapshots:
                if snapshot.future.set_running_or_notify_cancel():  # False: nobody waits
                    snapshot.future.set_result(self._snapshot())
            self.heartbeat = time.monotonic()

    def _observe(self, events: list[TokenEvent]) -> None:
        if self.metrics is None:
            return
        for event in events:
            safely(self.metrics.observe_event, event)
        core = self.core
        safely(
            self.metrics.set_queue_state, core.num_waiting, core.num_running, core.kv_cache_usage
        )

    def _wait_s(self) -> float | None:
        """How long to wait for a command: forever when idle, not at all while requests run,
        briefly when the last step could schedule nothing (so the thread does not spin)."""
        if not self.core.has_unfinished_requests():
            return None
        return _NOTHING_SCHEDULED_WAIT_S if self.scheduled_nothing else 0.0

    def _take_commands(self, wait_s: float | None) -> list[Command]:
        commands: list[Command] = []
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

    def _apply(self, command: Command) -> list[TokenEvent]:
        if isinstance(command, Add):
            spec = command.spec
            try:
                self.core.add_request(
                    spec.request_id,
                    spec.prompt_token_ids,
                    spec.params,
                    priority=spec.priority,
                    arrival_time=command.arrival_time,
                    cache_salt=spec.cache_salt,
                    tenant=command.tenant,
                )
            except Exception as exc:  # noqa: BLE001 - the route pre-checks; this is a backstop
                why = f"request rejected by the engine: {one_line(exc)}"
                return [_error_event(spec, why, command.arrival_time)]
            self.live.add(spec.request_id)
            return []
        if isinstance(command, Abort):
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
            return self._abort_all(f"engine step failed: {one_line(exc)}")
        self.scheduled_nothing = result.stats is None
        for event in result.events:
            if event.finished:
                self.live.discard(event.request_id)
        if result.stats is not None and self.metrics is not None:
            safely(self.metrics.observe_step, result.stats)
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
            invariants_ok, invariants_error = False, one_line(exc)
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


def safely(fn: Callable, *args: Any) -> None:
    """Metrics must never take the engine down: a failing hook is logged, not raised."""
    try:
        fn(*args)
    except Exception:
        log.exception("metrics hook %s failed", getattr(fn, "__qualname__", fn))


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
