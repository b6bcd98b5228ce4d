"""POST /v1/responses: OpenAI's Responses API, stateless, on the chat path.

`instructions` and `input` become chat messages rendered by the chat template; the sampling
fields become chat's (server/openai/protocol/responses.py); one engine request (n is always 1) runs
through the serving core (server/openai/serving_core.py) like a chat completion; this module builds
Responses' output. Streaming sends Responses' typed events (`event: <type>` + `data: <json>`, numbered by `sequence_number`):
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens ran out) carrying the whole response and usage.
Function tools take chat's tool path (server/tool_calls): each parsed call is a
function_call output item (streamed as output_item.added, function_call_arguments.delta and
.done, output_item.done).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request, Response

from scheduler.sampling_params import SamplingParams
from server.app_state import unix_time
from server.http.errors import OpenAIError
from server.openai.generation import Generation
from server.openai.protocol import Usage, dump
from server.openai.protocol.responses import ResponsesRequest
from server.openai.protocol.responses_output import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponsesResponse,
    ResponseUsage,
)
from server.openai.serving_core import ChatPrompt, GenerationJob, OpenAIServing
from server.tool_calls import (
    CallDelta,
    ContentDelta,
    StreamDelta,
    ToolCall,
    ToolCallFormat,
    ToolPolicy,
    resolve_tool_policy,
    stream_update,
)

router = APIRouter()

# The chat path names chat's parameters in its errors; a Responses client sent these instead:
# chat's param -> (the Responses param, the name to use in the message).
_RESPONSES_NAMES = {
    "max_tokens": ("max_output_tokens", "max_output_tokens"),
    "response_format": ("text", "text.format"),
    "messages": ("input", "input"),
}


@router.post("/v1/responses", response_model=ResponsesResponse)
async def create_response(request: Request) -> Response:
    serving, body = await OpenAIServing.open(request, ResponsesRequest)
    fields = body.sampling_fields()
    with _responses_names():
        tools = resolve_tool_policy(
            body.function_tools(), body.tool_choice_value(), body.parallel_tool_calls
        )
        job = GenerationJob(
            request_id=_new_id("resp"),
            fields=fields,
            prompt=ChatPrompt(body.messages()),
            max_tokens=fields.max_tokens,
            tools=tools,
        )
        submitted = await serving.start(job)
    builder = _ResponseBuilder(
        submitted.request_id,
        serving.model,
        body,
        submitted.params,
        submitted.tools,
        submitted.fmt,
        submitted.generation,
    )
    # Usage always rides on the last event; Responses' stream ends with it: no `data: [DONE]`.
    return await serving.respond(submitted, builder, body.stream, True, done=False)


@contextmanager
def _responses_names() -> Iterator[None]:
    """Re-raise the chat path's 400s under the Responses API's parameter names."""
    try:
        yield
    except OpenAIError as exc:
        if exc.param not in _RESPONSES_NAMES:
            raise
        message = exc.message
        for chat_name, (_, word) in _RESPONSES_NAMES.items():
            message = message.replace(chat_name, word)
        param = _RESPONSES_NAMES[exc.param][0]
        raise OpenAIError(exc.status, message, param=param, code=exc.code) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # OpenAI's spelling: resp_..., msg_...


class _ResponseBuilder:
    """Builds the Responses stream events and the final response from one Generation. With
    tool calls to parse, the text goes through the tool-call format's stream parser
    (streaming) or its parse (at the end) and calls become function_call items; otherwise
    all the text is one message item."""

    def __init__(
        self,
        response_id: str,
        model: str,
        body: ResponsesRequest,
        params: SamplingParams,
        tools: ToolPolicy,
        fmt: ToolCallFormat,
        generation: Generation,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.body = body
        self.params = params
        self.tools = tools
        self.fmt = fmt
        self.generation = generation
        self.created_at = unix_time()
        self.sequence_number = 0

    async def events(self, include_usage: bool = True) -> AsyncIterator[str]:
        """The typed event sequence; usage always comes with the last event."""
        started = dump(self._response("in_progress", []))
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        parser = self.fmt.stream(self.tools.max_calls) if self.tools.parses_calls else None
        items = _StreamedItems(self._event)
        async for update in self.generation.updates():
            if parser is None:
                deltas: list[StreamDelta] = [ContentDelta(update.text)]
            else:
                finished = update.finish_reason is not None
                deltas = stream_update(parser, update.text, finished)
            for delta in deltas:
                for event in items.add(delta):
                    yield event
        status = self._status()
        if not items.items:  # no text and no call: an empty message, as without streaming
            for event in items.add(ContentDelta("")):
                yield event
        for event in items.close_message("incomplete" if status == "incomplete" else "completed"):
            yield event
        final = self._finished(status, items.items)
        yield self._event(f"response.{status}", response=dump(final))

    def response(self) -> ResponsesResponse:
        text = self.generation.choices[0].detokenizer.text
        content: str | None = text
        calls: tuple[ToolCall, ...] = ()
        if self.tools.parses_calls:
            parsed = self.fmt.parse(text, self.tools.max_calls)
            content, calls = parsed.content, parsed.tool_calls
        status = self._status()
        output: list[OutputItem] = []
        if content is not None:
            message_status = "incomplete" if status == "incomplete" else "completed"
            output.append(_message(message_status, content))
        output += [_function_call(call) for call in calls]
        return self._finished(status, output)

    def _status(self) -> str:
        length = self.generation.choices[0].finish_reason == "length"
        return "incomplete" if length else "completed"

    def _finished(self, status: str, output: list[OutputItem]) -> ResponsesResponse:
        response = self._response(status, output, _usage(self.generation.usage()))
        response.completed_at = unix_time()
        if status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return response

    def _response(
        self, status: str, output: list[OutputItem], usage: ResponseUsage | None = None
    ) -> ResponsesResponse:
        body, tools = self.body, self.tools
        choice: str | dict[str, Any] = tools.mode
        if tools.mode == "named":
            choice = {"type": "function", "name": tools.name}
        return ResponsesResponse(
            id=self.response_id,
            created_at=self.created_at,
            status=status,
            instructions=body.instructions,
            model=self.model,
            output=output,
            max_output_tokens=body.max_output_tokens,
            temperature=self.params.temperature,
            top_p=self.params.top_p,
            text={"format": body.format.model_dump(mode="json", by_alias=True, exclude_none=True)},
            tools=[tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or ()],
            tool_choice=choice,
            parallel_tool_calls=tools.parallel,
            usage=usage,
        )

    def _event(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _StreamedItems:
    """The output items as they stream, and the events that build them: text goes into the
    open message item (opened by the first text); a call closes it and is one
    function_call item, its arguments in one delta. Text after a call opens a new message."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.event = event
        self.items: list[OutputItem] = []
        self.message: OutputMessage | None = None  # the open message item

    def add(self, delta: StreamDelta) -> Iterator[str]:
        if isinstance(delta, ContentDelta):
            yield from self._text(delta.text)
        else:
            assert isinstance(delta, CallDelta)
            yield from self.close_message("completed")
            yield from self._call(delta.call)

    def _text(self, text: str) -> Iterator[str]:
        if self.message is None:
            self.message = OutputMessage(id=_new_id("msg"), status="in_progress", content=[])
            yield self._added(self.message)
            part = OutputText(text="")
            yield self.event("response.content_part.added", **self._where(), part=dump(part))
            self.message.content.append(part)
        if text:
            self.message.content[0].text += text
            yield self.event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def close_message(self, status: str) -> Iterator[str]:
        if self.message is None:
            return
        where, message = self._where(), self.message
        self.message = None
        part = message.content[0]
        yield self.event("response.output_text.done", **where, text=part.text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=dump(part))
        message.status = status
        yield self.event(
            "response.output_item.done", output_index=where["output_index"], item=dump(message)
        )

    def _call(self, call: ToolCall) -> Iterator[str]:
        item = _function_call(call)
        item.arguments, item.status = "", "in_progress"
        index = len(self.items)
        yield self._added(item)
        where = {"item_id": item.id, "output_index": index}
        yield self.event("response.function_call_arguments.delta", **where, delta=call.arguments)
        item.arguments, item.status = call.arguments, "completed"
        yield self.event("response.function_call_arguments.done", **where, arguments=call.arguments)
        yield self.event("response.output_item.done", output_index=index, item=dump(item))

    def _added(self, item: OutputItem) -> str:
        self.items.append(item)
        index = len(self.items) - 1
        return self.event("response.output_item.added", output_index=index, item=dump(item))

    def _where(self) -> dict[str, Any]:
        assert self.message is not None
        index = self.items.index(self.message)
        return {"item_id": self.message.id, "output_index": index, "content_index": 0}


def _message(status: str, text: str) -> OutputMessage:
    return OutputMessage(id=_new_id("msg"), status=status, content=[OutputText(text=text)])


def _function_call(call: ToolCall) -> OutputFunctionCall:
    return OutputFunctionCall(
        id=_new_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments
    )


def _usage(usage: Usage) -> ResponseUsage:
    """Chat's usage (the request's bill) in Responses' names, with the same meter extension."""
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        **(usage.model_extra or {}),
    )
