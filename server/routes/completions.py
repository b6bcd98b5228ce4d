"""POST /v1/completions: prompt (string, strings, token ids) in, text out, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response

from scheduler.output import TokenLogprobs
from scheduler.sampling_params import SamplingParams
from server.body import parse_request
from server.detokenizer import TokenTexts
from server.engine_client import EngineClient
from server.errors import bad_request
from server.generation import ChoiceState, Generation
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    StreamProgress,
)
from server.request_group import EngineRequestSpec
from server.request_limits import MAX_PROMPTS, check_num_choices
from server.routes.deps import (
    billing_account,
    engine_cache_salt,
    get_settings,
    new_id,
    ready_client,
    respond,
    served_model_names,
    token_texts,
    unix_time,
)
from server.sampling import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    build_sampling_params,
    check_model,
    check_priority,
    check_stop_strings,
    check_token_ids,
    choice_params,
    resolve_max_tokens,
    structured_output_of,
    text_options,
    with_max_tokens,
)
from server.streaming import sse_event

router = APIRouter()

# Up to this many characters the tokenizer runs inline: it blocks the event loop for well under
# a millisecond (~0.5 ms for 1,000 characters with SmolLM2's tokenizer on 2 busy cores), and a
# hop to a worker thread (~130 us) would cost a short prompt more than tokenizing it.
INLINE_TOKENIZE_CHARS = 1_000

T = TypeVar("T")


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(request: Request) -> Response:
    body = await parse_request(
        request, CompletionRequest, get_settings(request).max_request_body_bytes
    )
    client = ready_client(request)
    model = check_model(body.model, served_model_names(request))
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request(
            "prompt_logprobs is not available with stream (as in vLLM); echo with logprobs "
            "streams the prompt's logprobs",
            param="prompt_logprobs",
        )
    settings = get_settings(request)
    check_num_choices(_num_prompts(body.prompt), body.n, settings.max_choices_per_request, "prompt")
    stop = check_stop_strings(body.stop_strings)
    priority = check_priority(body.priority, settings.engine.scheduling_policy)
    structured_output = await structured_output_of(body, client)  # 400: does not compile
    prompts = await tokenize_prompts(body.prompt, client)
    request_id = new_id("cmpl")
    salt = engine_cache_salt(request, body.cache_salt)
    params: SamplingParams | None = None  # built once; other prompts differ in max_tokens
    specs: list[EngineRequestSpec] = []
    for p_index, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(
            body.max_tokens,
            len(prompt),
            client.max_request_tokens,
            COMPLETIONS_DEFAULT_MAX_TOKENS,
            "prompt",
        )
        if params is None:
            params = build_sampling_params(
                body,
                max_tokens=max_tokens,
                logprobs=body.logprobs,
                vocab_size=client.vocab_size,
                tokenizer=client.tokenizer,
                prompt_logprobs=_num_prompt_logprobs(body),
                structured_output=structured_output,
            )
        for choice in choice_params(with_max_tokens(params, max_tokens), body.n):
            choice_id = f"{request_id}-{len(specs)}"
            specs.append(EngineRequestSpec(choice_id, prompt, choice, p_index, priority, salt))
    group = client.submit(specs, billing_account(request))
    generation = Generation(client, group, prompts, body.n, text_options(body, stop))
    echo_texts = (
        [_echo_text(body.prompt, prompts, i, client) for i in range(len(prompts))]
        if body.echo
        else None
    )
    stream = _Stream(
        request_id,
        model,
        generation,
        token_texts(request),
        echo_texts,
        body.logprobs,
        body.prompt_logprobs,
    )
    return await respond(
        request, client, group, generation, stream, body.stream, body.include_usage
    )


def _num_prompts(prompt: str | list) -> int:
    """How many prompts `prompt` holds (a string or a list of token ids is one)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _num_prompt_logprobs(body: CompletionRequest) -> int | None:
    """The top-k the engine computes at each prompt position: echo with logprobs shows the
    prompt's logprobs (k = logprobs), vLLM's prompt_logprobs asks its own k; None = neither."""
    asked = [body.logprobs if body.echo else None, body.prompt_logprobs]
    counts = [k for k in asked if k is not None]
    return max(counts) if counts else None


async def tokenize_prompts(prompt: str | list, client: EngineClient) -> list[list[int]]:
    """The request's prompts as token ids (a list of token ids is one prompt)."""
    if isinstance(prompt, str):
        prompts = await encode_texts(client.tokenizer, [prompt])
    elif not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], str):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        prompts = await encode_texts(client.tokenizer, prompt)
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    for ids in prompts:
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        check_token_ids(ids, client.vocab_size, "prompt")
    return prompts


async def encode_texts(
    tokenizer: Any, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each text, tokenized off the event loop when the texts are long."""

    def encode() -> list[list[int]]:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    return await off_loop(encode, sum(len(t) for t in texts))


async def off_loop(work: Callable[[], T], num_chars: int) -> T:
    """`work()` (tokenizing or rendering `num_chars` characters), in a worker thread when that
    is long enough to stall the event loop. A fast tokenizer releases the GIL while it encodes,
    so the loop keeps streaming other requests' tokens meanwhile; an error raised by `work`
    (a 400 for a bad prompt) reaches the caller the same either way."""
    if num_chars <= INLINE_TOKENIZE_CHARS:
        return work()
    return await asyncio.to_thread(work)


def _echo_text(
    prompt: str | list, prompts: list[list[int]], index: int, client: EngineClient
) -> str:
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return prompt[index]
    return client.tokenizer.decode(prompts[index])


class _Stream:
    """Builds the completions chunks and the final response from one Generation.

    Echo with logprobs: the choice's logprobs cover the prompt's tokens, then the completion's;
    the first prompt token has no logprob (null, with null top_logprobs, as OpenAI returns it).
    Streamed, a choice's echo chunk carries the prompt's part, so it is sent when the prompt's
    logprobs are in: with the choice's first token.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        generation: Generation,
        texts: TokenTexts,
        echo_texts: list[str] | None,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.generation = generation
        self.texts = texts
        self.echo_texts = echo_texts
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.echo_logprobs = echo_texts is not None and num_logprobs is not None
        self.created = unix_time()

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self.generation.n] if self.echo_texts else ""

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        unechoed: set[int] = set()  # choices whose echo waits for the prompt's logprobs
        if self.echo_texts:
            for state in self.generation.choices:
                if self.echo_logprobs:
                    unechoed.add(state.index)
                    continue
                echo = CompletionChoice(index=state.index, text=self._echo(state.index))
                yield sse_event(self._chunk([echo]))
        async for update in self.generation.updates():
            progress = self.generation.progress(update)
            if update.progress_only:  # a prefill chunk that produced no token
                yield sse_event(self._chunk([], progress))
                continue
            if update.index in unechoed:
                unechoed.discard(update.index)
                state = self.generation.choices[update.index]
                echo = CompletionChoice(
                    index=update.index,
                    text=self._echo(update.index),
                    logprobs=self._echo_logprobs(state),
                )
                yield sse_event(self._chunk([echo]))
            logprobs = None
            if self.num_logprobs is not None:
                offsets = [o + len(self._echo(update.index)) for o in update.text_offsets]
                logprobs = self._logprobs(update.logprobs, offsets)
            choice = CompletionChoice(
                index=update.index,
                text=update.text,
                logprobs=logprobs,
                finish_reason=update.finish_reason,
            )
            yield sse_event(self._chunk([choice], progress))
        if include_usage:
            final = self._chunk([])
            final.usage = self.generation.usage()
            yield sse_event(final)

    def _chunk(
        self, choices: list[CompletionChoice], progress: StreamProgress | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            meterserve=progress,
        )

    def response(self) -> CompletionResponse:
        choices = []
        for choice in self.generation.choices:
            echo = self._echo(choice.index)
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = self._logprobs(
                    choice.logprobs, [o + len(echo) for o in choice.text_offsets]
                )
                if self.echo_logprobs:
                    logprobs = _joined(self._echo_logprobs(choice), logprobs)
            choices.append(
                CompletionChoice(
                    index=choice.index,
                    text=echo + choice.detokenizer.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    prompt_logprobs=self._vllm_prompt_logprobs(choice),
                )
            )
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.generation.usage(),
        )

    def _logprobs(self, entries: list[TokenLogprobs], offsets: list[int]) -> CompletionLogprobs:
        texts = self.texts
        return CompletionLogprobs(
            tokens=[texts.text(e.token_id) for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[
                {texts.text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=False)}
                for e in entries
            ],
            text_offset=offsets,
        )

    def _prompt(self, choice: ChoiceState) -> list[int]:
        return self.generation.prompts[choice.index // self.generation.n]

    def _echo_logprobs(self, choice: ChoiceState) -> CompletionLogprobs:
        """The echoed prompt's part of `logprobs`: one entry per prompt token, the first null.
        text_offset counts the characters of the tokens before (a token's characters are its
        bytes that start one), so offsets line up with the echo of the prompt's decoded text."""
        texts = self.texts
        prompt = self._prompt(choice)
        offsets, num_chars = [], 0
        for token_id in prompt:
            offsets.append(num_chars)
            num_chars += sum(1 for b in texts.bytes(token_id) if b & 0xC0 != 0x80)
        k = self.num_logprobs or 0
        entries = choice.prompt_logprobs
        return CompletionLogprobs(
            tokens=[texts.text(t) for t in prompt],
            token_logprobs=[None, *(e.logprob for e in entries)],
            top_logprobs=[
                None,
                *(
                    {texts.text(t): lp for t, lp in zip(e.top_token_ids[:k], e.top_logprobs[:k])}
                    for e in entries
                ),
            ],
            text_offset=offsets,
        )

    def _vllm_prompt_logprobs(
        self, choice: ChoiceState
    ) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs`: null for the first prompt token, then for each later one
        {its id: its logprob and rank, and the top-k ids at its position: theirs}."""
        k = self.num_prompt_logprobs
        if k is None:
            return None
        text = self.texts.text
        result: list[dict[int, PromptLogprob] | None] = [None]
        for e in choice.prompt_logprobs:
            chosen = PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=text(e.token_id))
            position = {e.token_id: chosen}
            for rank, (t, lp) in enumerate(zip(e.top_token_ids[:k], e.top_logprobs[:k]), 1):
                position.setdefault(t, PromptLogprob(logprob=lp, rank=rank, decoded_token=text(t)))
            result.append(position)
        return result


def _joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )
