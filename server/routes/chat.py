"""POST /v1/chat/completions: messages through the tokenizer's chat template, streamed or not.

The request runs through the serving core (server/openai/serving_core.py); this module parses chat's
protocol into a GenerationJob and builds chat's chunks and response. With tools
(server/tool_calls), the template renders them (or meterserve's hermes prompt does, for a
template without tools), `required` and named tool_choice constrain the output with a
grammar, and calls are parsed from the text into `tool_calls`, whole or as streaming deltas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from scheduler.output import TokenLogprobs
from server.app_state import new_id, unix_time
from server.http.errors import bad_request
from server.http.sse import sse_event
from server.openai.generation import Generation
from server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    ResponseFunctionCall,
    ResponseToolCall,
    StreamProgress,
    TopLogprob,
)
from server.openai.serving_core import ChatPrompt, GenerationJob, OpenAIServing
from server.text.detokenizer import TokenTexts
from server.tool_calls import (
    CallDelta,
    ContentDelta,
    FunctionTool,
    StreamDelta,
    ToolCall,
    ToolCallFormat,
    ToolChoice,
    ToolPolicy,
    finish_reason_of,
    resolve_tool_policy,
    stream_update,
)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(request: Request) -> Response:
    serving, body = await OpenAIServing.open(request, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise bad_request(
            "give max_completion_tokens or max_tokens, not both", param="max_completion_tokens"
        )
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    job = GenerationJob(
        request_id=new_id("chatcmpl"),
        fields=body,
        prompt=ChatPrompt(body.messages, body.add_generation_prompt),
        max_tokens=(
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        ),
        n=body.n,
        logprobs=num_logprobs,
        tools=tool_policy_of(body),
    )
    submitted = await serving.start(job)
    builder = _ChatBuilder(
        submitted.request_id,
        serving.model,
        submitted.generation,
        serving.token_texts,
        num_logprobs,
        submitted.tools,
        submitted.fmt,
    )
    return await serving.respond(submitted, builder, body.stream, body.include_usage)


def tool_policy_of(body: ChatCompletionRequest) -> ToolPolicy:
    """The request's tools and tool_choice as plain values, checked (400s naming them)."""
    tools = [
        FunctionTool(
            t.function.name, t.function.description, t.function.parameters, t.function.strict
        )
        for t in body.tools or ()
        if t.function is not None  # check_fields refused the others
    ]
    choice = body.tool_choice
    if choice is None:
        resolved = None
    elif isinstance(choice, str):
        resolved = ToolChoice(choice)
    else:
        resolved = ToolChoice("named", choice.function.name)
    return resolve_tool_policy(tools, resolved, body.parallel_tool_calls)


class _ChatBuilder:
    """Builds chat chunks and the final chat response from one Generation. With tool calls to
    parse, each choice's text goes through the tool-call format's stream parser (streaming) or
    its parse (at the end); otherwise the text is the content as it comes."""

    def __init__(
        self,
        request_id: str,
        model: str,
        generation: Generation,
        texts: TokenTexts,
        num_logprobs: int | None,
        tools: ToolPolicy,
        fmt: ToolCallFormat,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.generation = generation
        self.texts = texts
        self.num_logprobs = num_logprobs
        self.tools = tools
        self.fmt = fmt
        self.created = unix_time()

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        parsers = {}
        if self.tools.parses_calls:
            parsers = {
                c.index: self.fmt.stream(self.tools.max_calls) for c in self.generation.choices
            }
        for state in self.generation.choices:
            first = ChatChunkChoice(index=state.index, delta={"role": "assistant", "content": ""})
            yield sse_event(self._chunk([first]))
        async for update in self.generation.updates():
            progress = self.generation.progress(update)
            if update.progress_only:  # a prefill chunk that produced no token
                yield sse_event(self._chunk([], progress))
                continue
            logprobs = None
            if self.num_logprobs is not None and update.logprobs:
                logprobs = self._logprobs(update.logprobs)
            parser = parsers.get(update.index)
            finish_reason = update.finish_reason
            if parser is None:
                deltas: list[dict[str, Any]] = [{"content": update.text} if update.text else {}]
            else:
                parsed = stream_update(parser, update.text, finished=finish_reason is not None)
                if finish_reason is not None:
                    finish_reason = finish_reason_of(finish_reason, parser.num_calls > 0)
                    if finish_reason == "tool_calls":
                        self.generation.label_tool_calls(update.index)
                deltas = [d for delta in parsed for d in _delta_dicts(delta)]
                if not (deltas or logprobs or progress or finish_reason):
                    continue  # text held back (a call may be starting): nothing to say yet
                deltas = deltas or [{}]
            # One chunk per delta; the update's logprobs and progress ride on the first, its
            # finish_reason on the last.
            for k, delta in enumerate(deltas):
                choice = ChatChunkChoice(
                    index=update.index,
                    delta=delta,
                    logprobs=logprobs if k == 0 else None,
                    finish_reason=finish_reason if k == len(deltas) - 1 else None,
                )
                yield sse_event(self._chunk([choice], progress if k == 0 else None))
        if include_usage:
            final = self._chunk([])
            final.usage = self.generation.usage()
            yield sse_event(final)

    def _chunk(
        self, choices: list[ChatChunkChoice], progress: StreamProgress | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            meterserve=progress,
        )

    def response(self) -> ChatCompletionResponse:
        choices = []
        for choice in self.generation.choices:
            message = AssistantMessage(content=choice.detokenizer.text)
            finish_reason = choice.finish_reason
            if self.tools.parses_calls:
                parsed = self.fmt.parse(choice.detokenizer.text, self.tools.max_calls)
                calls = [_response_call(call) for call in parsed.tool_calls]
                message = AssistantMessage(content=parsed.content, tool_calls=calls or None)
                finish_reason = finish_reason_of(finish_reason, bool(calls))
                if finish_reason == "tool_calls":
                    self.generation.label_tool_calls(choice.index)
            choices.append(
                ChatChoice(
                    index=choice.index,
                    message=message,
                    logprobs=(
                        self._logprobs(choice.logprobs) if self.num_logprobs is not None else None
                    ),
                    finish_reason=finish_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.generation.usage(),
        )

    def _logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        texts = self.texts
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=texts.text(e.token_id),
                    logprob=e.logprob,
                    bytes=texts.bytes(e.token_id),
                    top_logprobs=[
                        TopLogprob(token=texts.text(t), logprob=lp, bytes=texts.bytes(t))
                        for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=False)
                    ],
                )
                for e in entries
            ]
        )


def _response_call(call: ToolCall) -> ResponseToolCall:
    return ResponseToolCall(
        id=call.id, function=ResponseFunctionCall(name=call.name, arguments=call.arguments)
    )


def _delta_dicts(delta: StreamDelta) -> list[dict[str, Any]]:
    """A parsed delta in OpenAI's shape: content as is; a call as its header (id, name,
    empty arguments), then its arguments as one fragment."""
    if isinstance(delta, ContentDelta):
        return [{"content": delta.text}]
    assert isinstance(delta, CallDelta)
    call = delta.call
    header = {
        "index": delta.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
    arguments = {"index": delta.index, "function": {"arguments": call.arguments}}
    return [{"tool_calls": [header]}, {"tool_calls": [arguments]}]
