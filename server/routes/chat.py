"""POST /v1/chat/completions: messages through the tokenizer's chat template, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

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
    StreamProgress,
    TopLogprob,
)
from server.request_group import EngineRequestSpec
from server.routes.completions import off_loop
from server.routes.deps import (
    billing_account,
    get_settings,
    new_id,
    ready_client,
    respond,
    served_model_names,
    token_texts,
    unix_time,
)
from server.sampling import (
    build_sampling_params,
    check_model,
    check_priority,
    check_stop_strings,
    resolve_max_tokens,
    structured_output_of,
    text_options,
)
from server.streaming import sse_event

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(request: Request) -> Response:
    body = await parse_request(
        request, ChatCompletionRequest, get_settings(request).max_request_body_bytes
    )
    client = ready_client(request)
    model = check_model(body.model, served_model_names(request))
    stop = check_stop_strings(body.stop_strings)
    priority = check_priority(body.priority, get_settings(request).engine.scheduling_policy)
    structured_output = structured_output_of(body)  # 400 when it does not compile
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise bad_request(
            "give max_completion_tokens or max_tokens, not both", param="max_completion_tokens"
        )
    prompt = await apply_chat_template(client, body.messages, body.add_generation_prompt)
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens = resolve_max_tokens(
        requested, len(prompt), client.max_request_tokens, None, "messages"
    )
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request_id = new_id("chatcmpl")
    specs = [
        EngineRequestSpec(
            f"{request_id}-{j}",
            prompt,
            build_sampling_params(
                body,
                max_tokens=max_tokens,
                logprobs=num_logprobs,
                vocab_size=client.vocab_size,
                choice_index=j,
                tokenizer=client.tokenizer,
                structured_output=structured_output,
            ),
            priority=priority,
        )
        for j in range(body.n)
    ]
    group = client.submit(specs, billing_account(request))
    generation = Generation(client, group, [prompt], body.n, text_options(body, stop))
    builder = _ChatBuilder(request_id, model, generation, token_texts(request), num_logprobs)
    return await respond(
        request, client, group, generation, builder, body.stream, body.include_usage
    )


async def apply_chat_template(
    client: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Render messages with the tokenizer's chat template, then tokenize the text as is; both
    off the event loop when the messages are long."""
    conversation = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    tokenizer = client.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")

    def render() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the user's
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None
        # The template already holds the special tokens (BOS, role markers): add none.
        return tokenizer.encode(text, add_special_tokens=False)

    return await off_loop(render, sum(len(turn["content"]) for turn in conversation))


class _ChatBuilder:
    """Builds chat chunks and the final chat response from one Generation."""

    def __init__(
        self,
        request_id: str,
        model: str,
        generation: Generation,
        texts: TokenTexts,
        num_logprobs: int | None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.generation = generation
        self.texts = texts
        self.num_logprobs = num_logprobs
        self.created = unix_time()

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        for state in self.generation.choices:
            first = ChatChunkChoice(index=state.index, delta={"role": "assistant", "content": ""})
            yield sse_event(self._chunk([first]))
        async for update in self.generation.updates():
            progress = self.generation.progress(update)
            if update.progress_only:  # a prefill chunk that produced no token
                yield sse_event(self._chunk([], progress))
                continue
            delta = {"content": update.text} if update.text else {}
            logprobs = None
            if self.num_logprobs is not None and update.logprobs:
                logprobs = self._logprobs(update.logprobs)
            choice = ChatChunkChoice(
                index=update.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=update.finish_reason,
            )
            yield sse_event(self._chunk([choice], progress))
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
        choices = [
            ChatChoice(
                index=choice.index,
                message=AssistantMessage(content=choice.detokenizer.text),
                logprobs=self._logprobs(choice.logprobs) if self.num_logprobs is not None else None,
                finish_reason=choice.finish_reason,
            )
            for choice in self.generation.choices
        ]
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
