"""Generation: one HTTP request's choices, fed by engine events, producing text updates.

Both endpoints and both modes (stream or not) consume the same `updates()` iterator, so the
concatenated stream and the non-streamed text are built from the same pieces.

Choice index i belongs to prompt i // n. A choice ends when the engine finishes it or when
a stop string matches; then its engine request is aborted (freeing its blocks) and its final
event (timings, cost) still arrives for `usage`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from scheduler.output import TokenEvent, TokenLogprobs
from server.detokenizer import IncrementalDetokenizer
from server.engine_client import EngineClient, RequestGroup
from server.errors import OpenAIError
from server.protocol import PromptTokensDetails, Usage

T = TypeVar("T")

# usage-extension fields that add up over a request's choices; the others (latencies) take
# the slowest choice.
_ADDITIVE_USAGE_FIELDS = frozenset({"cost_usd", "flops", "prefill_seconds", "decode_seconds"})


@dataclass(slots=True)
class ChoiceUpdate:
    """What one event changed in one choice. `text_offsets[i]` is where token i's text
    starts in the choice's text (approximate when several tokens arrive in one event)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    text_offsets: list[int]
    finish_reason: str | None


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
        stop: list[str],
    ) -> None:
        self.client = client
        self.group = group
        self.prompts = prompts
        self.n = n
        self.choices = [
            ChoiceState(
                index=i,
                request_id=spec.request_id,
                detokenizer=IncrementalDetokenizer(client.tokenizer, prompts[i // n], stop),
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
        if event.finish_reason == "error":
            raise OpenAIError(500, f"request failed: {event.error}", code="engine_error")
        if event.finish_reason == "abort":
            reason = event.error or "aborted by the engine"
            raise OpenAIError(500, f"request ended early: {reason}", code="request_aborted")
        offset = len(choice.detokenizer.text)
        text = choice.detokenizer.add(event.new_token_ids)
        n_new = len(event.new_token_ids)
        choice.token_ids.extend(event.new_token_ids)
        choice.logprobs.extend(event.logprobs)
        offsets = [offset] * len(event.logprobs)
        choice.text_offsets.extend(offsets)
        if choice.detokenizer.stopped:
            choice.finish_reason = "stop"
            if not event.finished:
                self.client.abort(self.group, choice.request_id)
        elif event.finished:
            text += choice.detokenizer.finish()
            choice.finish_reason = event.finish_reason
        if not (text or n_new or choice.finish_reason):
            return None
        return ChoiceUpdate(
            choice.index,
            text,
            list(event.new_token_ids),
            list(event.logprobs),
            offsets,
            choice.finish_reason,
        )

    def usage(self) -> Usage:
        """Token counts (prompt once per prompt; completion tokens consumed by each choice)
        plus the meter's per-request extension merged over choices."""
        completion = sum(choice.detokenizer.num_tokens for choice in self.choices)
        prompt = sum(len(p) for p in self.prompts)
        cached = 0
        for p_index in range(len(self.prompts)):
            events = [
                c.final_event for c in self.choices[p_index * self.n : (p_index + 1) * self.n]
            ]
            cached += min((e.num_cached_tokens for e in events if e is not None), default=0)
        extension = self._usage_extension()
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            **extension,
        )

    def _usage_extension(self) -> dict[str, float]:
        metrics = self.client.metrics
        if metrics is None:
            return {}
        merged: dict[str, float] = {}
        for choice in self.choices:
            if choice.final_event is None:
                continue
            for key, value in metrics.usage_extension(choice.final_event).items():
                if key not in merged:
                    merged[key] = value
                elif key in _ADDITIVE_USAGE_FIELDS:
                    merged[key] += value
                else:
                    merged[key] = max(merged[key], value)
        return merged


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
