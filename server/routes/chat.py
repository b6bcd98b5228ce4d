"""POST /v1/chat/completions: messages through the tokenizer's chat template, streamed or not.

With tools (server/tool_calls), the template renders them (or meterserve's hermes prompt does,
for a template without tools), `required` and named tool_choice constrain the output with a
grammar, and calls are parsed from the text into `tool_calls`, whole or as streaming deltas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request, Response

from scheduler.output import TokenLogprobs
from server.body import parse_request
from server.detokenizer import TokenTexts
from server.engine_client import EngineClient
from server.errors import bad_request
from server.generation import Generation
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ResponseFunctionCall,
    ResponseToolCall,
    StreamProgress,
    TopLogprob,
)
from server.request_group import EngineRequestSpec
from server.request_limits import check_num_choices
from server.routes.completions import off_loop
from server.routes.deps import (
    billing_account,
    engine_cache_salt,
    get_settings,
    new_id,
    ready_client,
    respond,
    served_model_names,
    token_texts,
    tool_format,
    tool_text_options,
    unix_time,
)
from server.sampling import (
    build_sampling_params,
    check_model,
    check_priority,
    check_stop_strings,
    choice_params,
    resolve_max_tokens,
    structured_output_of,
    text_options,
)
from server.streaming import sse_event
from server.tool_calls import (
    CallDelta,
    ContentDelta,
    FunctionTool,
    StreamDelta,
    ToolCall,
    ToolCallFormat,
    ToolChoice,
    ToolPolicy,
    conversation_for_template,
    finish_reason_of,
    output_constraint,
    resolve_tool_policy,
    stream_update,
)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(request: Request) -> Response:
    body = await parse_request(
        request, ChatCompletionRequest, get_settings(request).max_request_body_bytes
    )
    client = ready_client(request)
    model = check_model(body.model, served_model_names(request))
    check_num_choices(1, body.n, get_settings(request).max_choices_per_request, "messages")
    stop = check_stop_strings(body.stop_strings)
    priority = check_priority(body.priority, get_settings(request).engine.scheduling_policy)
    structured_output = await structured_output_of(body, client)  # 400: does not compile
    tools = tool_policy_of(body)
    fmt = tool_format(request, tools.tools)
    # required / named tool_choice: a grammar, so calls always parse
    structured_output = await output_constraint(
        structured_output, tools, "response_format / structured_outputs", client, fmt
    )
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise bad_request(
            "give max_completion_tokens or max_tokens, not both", param="max_completion_tokens"
        )
    prompt = await apply_chat_template(
        client, body.messages, body.add_generation_prompt, tools.tools
    )
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens = resolve_max_tokens(
        requested, len(prompt), client.max_request_tokens, None, "messages"
    )
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request_id = new_id("chatcmpl")
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=num_logprobs,
        vocab_size=client.vocab_size,
        tokenizer=client.tokenizer,
        structured_output=structured_output,
    )
    salt = engine_cache_salt(request, body.cache_salt)
    specs = [
        EngineRequestSpec(f"{request_id}-{j}", prompt, choice, priority=priority, cache_salt=salt)
        for j, choice in enumerate(choice_params(params, body.n))
    ]
    group = client.submit(specs, billing_account(request))
    options = tool_text_options(text_options(body, stop), fmt, tools)
    generation = Generation(client, group, [prompt], body.n, options)
    builder = _ChatBuilder(
        request_id, model, generation, token_texts(request), num_logprobs, tools, fmt
    )
    return await respond(
        request, client, group, generation, builder, body.stream, body.include_usage
    )


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


async def apply_chat_template(
    client: EngineClient,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: Sequence[FunctionTool] = (),
) -> list[int]:
    """Render messages (and tools, with their tool-call history) with the tokenizer's chat
    template, then tokenize the text as is; both off the event loop when the messages are
    long."""
    tokenizer = client.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    conversation, tools_arg = conversation_for_template(
        [_turn(m) for m in messages], tools, template
    )
    extra = {} if tools_arg is None else {"tools": tools_arg}

    def render() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the user's
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None
        # The template already holds the special tokens (BOS, role markers): add none.
        return tokenizer.encode(text, add_special_tokens=False)

    return await off_loop(render, sum(len(turn["content"]) for turn in conversation))


def _turn(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (OpenAI's shape; developer is system)."""
    turn: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


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
