"""RequestGroup: one API request's engine requests, the queue their events arrive on, and
what its settlement needs: tokens delivered, each choice's finish reason, final events.

Lifecycle (loop thread only):
  submit() creates the group -> the route's Generation consumes its events, reporting the
  tokens it delivered and each choice's finish reason as the client got it -> release() ends
  the HTTP side and aborts what is unfinished -> the group is *settled* once it is released
  and every engine request has sent its final event (an abort's acknowledgement included).
Settling books the group's bill exactly once (EngineClient._settle). `usage` is built from
the same bill(), so the counters equal what clients were told.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from engine.meter.billing import Bill, ChoiceReading, Prices, bill_request
from scheduler.output import TokenEvent
from scheduler.sampling_params import SamplingParams
from server.http.errors import OpenAIError

# Why a choice that never finished on its own ended, as its finish_reason label says it.
CLIENT_LEFT = "abort"
TIMED_OUT = "timeout"
FAILED = "error"

# Grammar compile seconds of the HTTP request being handled (its own task's context): the route
# compiles (server/openai/structured_output_fields.py) before it submits, and the group it submits
# takes them.
_grammar_compile_seconds: ContextVar[float] = ContextVar("grammar_compile_seconds", default=0.0)


def charge_grammar_compile(seconds: float) -> None:
    """Bill `seconds` of grammar compiling to the next group this request submits."""
    _grammar_compile_seconds.set(_grammar_compile_seconds.get() + seconds)


@dataclass(frozen=True, slots=True)
class EngineRequestSpec:
    """One engine request: one choice of one prompt (prompt_index counts the API request's
    prompts, so a prompt shared by n choices is billed once)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    priority: int = 0  # lower runs first under --scheduling-policy priority
    cache_salt: str = (
        ""  # prefix-cache key (server/tenancy/cache_salt.py): tenant + the client's salt
    )


@dataclass(frozen=True, slots=True)
class BillingAccount:
    """Whom a group is billed to: a bounded tenant label and the prices that apply."""

    tenant: str
    prices: Prices


@dataclass(frozen=True, slots=True)
class Settlement:
    """A finished group, as the exporter books it."""

    tenant: str
    bill: Bill
    finish_reasons: list[str]  # per choice, as the client got (or would have got) them
    final_events: list[TokenEvent | None]  # None where the engine never reported back
    delivered: list[int]  # per choice, output tokens that went into the response


class RequestGroup:
    """One HTTP request's engine requests and the queue their events arrive on, in order.

    Items on the queue are (choice index, TokenEvent), or an OpenAIError when the server
    ends the request itself (shutdown, engine failure).
    """

    def __init__(
        self,
        specs: list[EngineRequestSpec],
        deadline: float | None,
        account: BillingAccount,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        self.specs = specs
        self.deadline = deadline  # loop.time() seconds, or None
        self.account = account
        self._on_timeout = on_timeout
        self.queue: asyncio.Queue[tuple[int, TokenEvent] | OpenAIError] = asyncio.Queue()
        self.index = {spec.request_id: i for i, spec in enumerate(specs)}  # -> choice index
        self.unfinished: set[str] = set(self.index)
        self.queued: set[str] = set(self.unfinished)  # not yet past admission's queue
        self.aborted: set[str] = set()  # abort sent, final event pending
        self.num_tokens_seen = 0
        self.delivered = [0] * len(specs)  # output tokens that went into the response
        self.finish_reasons: list[str | None] = [None] * len(specs)
        self.final_events: list[TokenEvent | None] = [None] * len(specs)
        self.end_reason = CLIENT_LEFT  # for choices still unfinished at release
        self.grammar_compile_seconds = _grammar_compile_seconds.get()  # charged once, here
        _grammar_compile_seconds.set(0.0)
        self.released = False
        self.settled = False

    async def next_event(self) -> tuple[int, TokenEvent]:
        """The next event of any choice; raises OpenAIError on timeout or server failure."""
        try:
            async with asyncio.timeout_at(self.deadline):
                item = await self.queue.get()
        except TimeoutError:
            self.end_reason = TIMED_OUT
            if self._on_timeout is not None:
                self._on_timeout()
            raise OpenAIError(
                408,
                f"request timed out: it did not finish within the server's request timeout "
                f"({self.num_tokens_seen} tokens had been generated)",
                code="request_timeout",
            ) from None
        if isinstance(item, OpenAIError):
            self.end_reason = FAILED
            raise item
        self.num_tokens_seen += len(item[1].new_token_ids)
        return item

    @property
    def complete(self) -> bool:
        """Every engine request has sent its final event."""
        return all(event is not None for event in self.final_events)

    def client_finish_reasons(self) -> list[str]:
        return [reason or self.end_reason for reason in self.finish_reasons]

    def bill(self, hardware_price_per_second: float) -> Bill:
        prompt_lengths = {spec.prompt_index: len(spec.prompt_token_ids) for spec in self.specs}
        readings = [
            ChoiceReading(
                prompt_index=spec.prompt_index,
                num_cached_tokens=event.num_cached_tokens if event is not None else 0,
                num_computed_tokens=event.num_output_tokens if event is not None else 0,
                num_delivered_tokens=delivered,
                cost=event.cost if event is not None else None,
            )
            for spec, event, delivered in zip(
                self.specs, self.final_events, self.delivered, strict=True
            )
        ]
        return bill_request(
            list(prompt_lengths.values()),
            readings,
            self.account.prices,
            hardware_price_per_second,
            self.grammar_compile_seconds,
        )

    def settlement(self, hardware_price_per_second: float) -> Settlement:
        return Settlement(
            tenant=self.account.tenant,
            bill=self.bill(hardware_price_per_second),
            finish_reasons=self.client_finish_reasons(),
            final_events=list(self.final_events),
            delivered=list(self.delivered),
        )
