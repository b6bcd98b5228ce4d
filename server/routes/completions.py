"""POST /v1/completions: prompt (string, strings, token ids) in, text out, streamed or not.

The request runs through the serving core (server/openai/serving_core.py); this module parses the
completions protocol into a GenerationJob and builds its chunks and response (echo, logprobs
of the prompt and the completion, vLLM's prompt_logprobs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response

from scheduler.output import TokenLogprobs
from server.app_state import new_id, unix_time
from server.engine_client.client import EngineClient
from server.http.errors import bad_request
from server.http.sse import sse_event
from server.openai.generation import ChoiceState, Generation
from server.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    StreamProgress,
)
from server.openai.request_params import COMPLETIONS_DEFAULT_MAX_TOKENS
from server.openai.serving_core import GenerationJob, OpenAIServing, TextPrompt
from server.text.detokenizer import TokenTexts

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(request: Request) -> Response:
    serving, body = await OpenAIServing.open(request, CompletionRequest)
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request(
            "prompt_logprobs is not available with stream (as in vLLM); echo with logprobs "
            "streams the prompt's logprobs",
            param="prompt_logprobs",
        )
    job = GenerationJob(
        request_id=new_id("cmpl"),
        fields=body,
        prompt=TextPrompt(body.prompt),
        max_tokens=body.max_tokens,
        n=body.n,
        logprobs=body.logprobs,
        prompt_logprobs=_num_prompt_logprobs(body),
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
    )
    submitted = await serving.start(job)
    echo_texts = (
        [
            _echo_text(body.prompt, submitted.prompts, i, serving.client)
            for i in range(len(submitted.prompts))
        ]
        if body.echo
        else None
    )
    stream = _Stream(
        submitted.request_id,
        serving.model,
        submitted.generation,
        serving.token_texts,
        echo_texts,
        body.logprobs,
        body.prompt_logprobs,
    )
    return await serving.respond(submitted, stream, body.stream, body.include_usage)


def _num_prompt_logprobs(body: CompletionRequest) -> int | None:
    """The top-k the engine computes at each prompt position: echo with logprobs shows the
    prompt's logprobs (k = logprobs), vLLM's prompt_logprobs asks its own k; None = neither."""
    asked = [body.logprobs if body.echo else None, body.prompt_logprobs]
    counts = [k for k in asked if k is not None]
    return max(counts) if counts else None


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
