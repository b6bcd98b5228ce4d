"""Generation: one HTTP request's choices, fed by engine events, producing text updates.

Both endpoints and both modes (stream or not) consume the same `updates()` iterator, so the
concatenated stream and the non-streamed text are built from the same pieces.

Choice index i belongs to prompt i // n. A choice ends when the engine finishes it or when
a stop string matches; then its engine request is finished as stopped (freeing its blocks)
and its final event (timings, cost) still arrives for `usage`. Every token that goes into
the response is reported to the client as delivered, so the bill and the counters count
exactly what the client got: an event's tokens past the one that completed a stop string
are dropped (token ids and logprobs alike), and the engine's stop token (EOS or a stop
token id) counts, though its text shows only with include_stop_str_in_output.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from scheduler.output import ChunkProgress, TokenEvent, TokenLogprobs
from server.engine_client.client import EngineClient
from server.engine_client.request_group import FAILED, RequestGroup
from server.http.errors import OpenAIError
from server.openai.protocol import PromptTokensDetails, StreamProgress, Usage
from server.text.detokenizer import IncrementalDetokenizer, TextOptions

T = TypeVar("T")


@dataclass(slots=True)
class ChoiceUpdate:
    """What one event changed in one choice. `text_offsets[i]` is where token i's text
    starts in the choice's text (approximate when several tokens arrive in one event).
    `progress` is set for a request that asked for it (stream_options.include_progress); an
    update with progress and nothing else is a prefill chunk that produced no token."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    text_offsets: list[int]
    finish_reason: str | None
    progress: ChunkProgress | None = None
    arrival_time: float | None = None  # the choice's arrival (monotonic), for elapsed times

    @property
    def progress_only(self) -> bool:
        return not (self.text or self.token_ids or self.finish_reason)


@dataclass(slots=True)
class ChoiceState:
    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer
    finish_reason: str | None = None
    final_event: TokenEvent | None = None  # the engine's finishing event (usage, cost)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    # Logprobs of prompt tokens 1.. (SamplingParams.prompt_logprobs), complete before the
    # choice's first token arrives: the step that samples it computes the prompt's end.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None and self.final_event is not None


class Generation:
    """Drives one RequestGroup to the end of every choice."""

    def __init__(
        self,
        client: EngineClient,
        group: RequestGroup,
        prompts: list[list[int]],
        n: int,
        text: TextOptions,
    ) -> None:
        self.client = client
        self.group = group
        self.prompts = prompts
        self.n = n
        self.choices = [
            ChoiceState(
                index=i,
                request_id=spec.request_id,
                detokenizer=IncrementalDetokenizer.for_options(
                    client.tokenizer, prompts[i // n], text
                ),
            )
            for i, spec in enumerate(group.specs)
        ]

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Text updates until every choice has finished and reported its final event."""
        while not all(choice.done for choice in self.choices):
            index, event = await self.group.next_event()
            update = self._apply(self.choices[index], event)
            if update is not None:
                yield update

    async def run(self) -> None:
        """Consume everything (the non-streaming path); results stay in `choices`."""
        async for _ in self.updates():
            pass

    def _apply(self, choice: ChoiceState, event: TokenEvent) -> ChoiceUpdate | None:
        if event.finished:
            choice.final_event = event
        if choice.finish_reason is not None:
            return None  # stopped by a stop string; this is the abort's acknowledgement
        if event.finish_reason in ("error", "abort"):
            self._fail(choice, event)
        choice.prompt_logprobs.extend(event.prompt_logprobs)
        offset = len(choice.detokenizer.text)
        consumed = choice.detokenizer.num_tokens
        # finish_reason "stop" from the engine: its last token is EOS or a stop token id.
        on_stop_token = event.finished and event.finish_reason == "stop"
        text = choice.detokenizer.add(event.new_token_ids, ends_in_stop_token=on_stop_token)
        n_new = choice.detokenizer.num_tokens - consumed
        self.client.deliver(self.group, choice.index, n_new)
        new_token_ids = list(event.new_token_ids[:n_new])
        new_logprobs = list(event.logprobs[:n_new])
        choice.token_ids.extend(new_token_ids)
        choice.logprobs.extend(new_logprobs)
        offsets = [offset] * len(new_logprobs)
        choice.text_offsets.extend(offsets)
        if choice.detokenizer.stopped:
            self._finish(choice, "stop")
            if not event.finished:
                self.client.stop(self.group, choice.request_id)
        elif event.finished:
            text += choice.detokenizer.finish()
            self._finish(choice, event.finish_reason)
        if not (text or n_new or choice.finish_reason or event.progress):
            return None
        return ChoiceUpdate(
            choice.index,
            text,
            new_token_ids,
            new_logprobs,
            offsets,
            choice.finish_reason,
            event.progress,
            event.arrival_time,
        )

    def _finish(self, choice: ChoiceState, reason: str | None) -> None:
        choice.finish_reason = reason
        self.group.finish_reasons[choice.index] = reason

    def label_tool_calls(self, index: int) -> None:
        """Choice `index` ended with tool calls: its client got `tool_calls` (not `stop`), and
        the metrics book the label the client got."""
        self._finish(self.choices[index], "tool_calls")

    def _fail(self, choice: ChoiceState, event: TokenEvent) -> None:
        """The engine ended the choice with an error (or aborted it on its own)."""
        self._finish(choice, FAILED)
        self.group.end_reason = FAILED
        if event.finish_reason == "error":
            raise OpenAIError(500, f"request failed: {event.error}", code="engine_error")
        reason = event.error or "aborted by the engine"
        raise OpenAIError(500, f"request ended early: {reason}", code="request_aborted")

    def progress(self, update: ChoiceUpdate) -> StreamProgress | None:
        """The chunk's `meterserve` object (None unless the request asked for progress)."""
        progress = update.progress
        if progress is None:
            return None
        price = self.client.meter_config.hardware_price_per_second
        cost = progress.cost
        arrival = update.arrival_time if update.arrival_time is not None else progress.computed_at
        return StreamProgress(
            index=update.index,
            forward_pass=progress.step_index,
            phase="decode" if progress.is_decode else "prefill",
            batch_size=progress.num_scheduled_requests,
            start_position=progress.start_position,
            num_tokens=progress.num_new_tokens,
            prompt_tokens=progress.num_prompt_tokens,
            prompt_tokens_computed=progress.num_prompt_tokens_computed,
            token_ids=update.token_ids,
            elapsed_seconds=progress.computed_at - arrival,
            prefill_flops=cost.prefill_flops,
            decode_flops=cost.decode_flops,
            prefill_cost_usd=cost.prefill_seconds * price,
            decode_cost_usd=cost.decode_seconds * price,
            draft_tokens=progress.num_draft_tokens,
            accepted_draft_tokens=progress.num_accepted_draft_tokens,
        )

    def usage(self) -> Usage:
        """OpenAI's token counts and the meter's extension, from the request's bill (the same
        bill the counters book when the request is settled)."""
        bill = self.client.bill(self.group)
        return Usage(
            prompt_tokens=bill.prompt_tokens,
            completion_tokens=bill.completion_tokens,
            total_tokens=bill.prompt_tokens + bill.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=bill.cached_tokens),
            cost_usd=bill.cost_usd,
            revenue_usd=bill.revenue_usd,
            prefill_seconds=bill.prefill_seconds,
            decode_seconds=bill.decode_seconds,
            flops=bill.flops,
            prefill_flops=bill.prefill_flops,
            decode_flops=bill.decode_flops,
            prefill_cost_usd=bill.prefill_cost_usd,
            decode_cost_usd=bill.decode_cost_usd,
            grammar_compile_seconds=bill.grammar_compile_seconds,
            **_latencies(self.group.final_events),
        )


def _latencies(events: list[TokenEvent | None]) -> dict[str, float]:
    """queue_seconds and time_to_first_token_seconds of the slowest choice; a timing no
    choice reached is left out."""
    queue: list[float] = []
    ttft: list[float] = []
    for event in events:
        times = event.times if event is not None else None
        if times is None:
            continue
        scheduled = times.first_scheduled if times.first_scheduled is not None else times.finished
        if scheduled is not None:
            queue.append(scheduled - times.arrival)
        if times.first_token is not None:
            ttft.append(times.first_token - times.arrival)
    fields = {}
    if queue:
        fields["queue_seconds"] = max(queue)
    if ttft:
        fields["time_to_first_token_seconds"] = max(ttft)
    return fields


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _wait_disconnect(request: Request) -> Any:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return message
