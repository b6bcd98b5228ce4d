"""The serving core (server/openai/serving_core.py), the one pipeline chat, completions and Responses
run: a GenerationJob becomes n engine requests per prompt with SamplingParams built once, the checks
every endpoint shares refuse before anything is submitted, and respond() collects the generation
into the endpoint's response and releases the group.

The engine client is real but its engine thread never starts: the test plays the thread's
part (the ready report, one final token event), so what is checked is what the core hands
the engine and what it makes of the engine's answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from fastapi import Request
from pydantic import BaseModel
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.loader import hf_checkpoint_dir
from scheduler.output import TokenEvent
from server.engine_client.client import EngineClient
from server.http.errors import OpenAIError
from server.openai.generation import Generation
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.serving_core import ChatPrompt, GenerationJob, OpenAIServing, TextPrompt
from server.settings import Settings

MAX_REQUEST_TOKENS = 2048


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(hf_checkpoint_dir("default"))


async def _never() -> dict:
    await asyncio.Event().wait()  # the client never disconnects
    return {}


def _serving(tokenizer, settings: Settings | None = None) -> OpenAIServing:
    settings = settings if settings is not None else Settings()
    client = EngineClient(
        EngineConfig(), max_waiting_requests=64, max_queued_tokens=1 << 20, request_timeout=None
    )
    core = SimpleNamespace(
        tokenizer=tokenizer,
        model_name="smollm2",
        max_model_len=MAX_REQUEST_TOKENS,
        max_request_tokens=MAX_REQUEST_TOKENS,
        kv_cache_info=SimpleNamespace(max_tokens=1 << 16),
    )
    client._on_ready(core, None)  # what the engine thread reports once the model has loaded
    app = SimpleNamespace(state=SimpleNamespace(settings=settings, engine_client=client))
    request = Request({"type": "http", "app": app, "headers": []}, receive=_never)
    return OpenAIServing(request, settings, client, "smollm2")


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def _chat_job(body: ChatCompletionRequest, **fields) -> GenerationJob:
    prompt = ChatPrompt(body.messages, body.add_generation_prompt)
    return GenerationJob("chatcmpl-t", body, prompt, body.max_tokens, n=body.n, **fields)


def test_prompts_times_n_become_engine_requests_sharing_one_params(tokenizer):
    serving = _serving(tokenizer)
    body = CompletionRequest.model_validate(
        {"prompt": ["Hello", "Hi there, friend"], "n": 2, "seed": 7}
    )
    job = GenerationJob("cmpl-t", body, TextPrompt(body.prompt), None, n=2, default_max_tokens=16)
    submitted = asyncio.run(serving.start(job))
    specs = submitted.group.specs
    prompts = [tokenizer.encode("Hello"), tokenizer.encode("Hi there, friend")]
    assert submitted.prompts == prompts
    assert [s.request_id for s in specs] == [f"cmpl-t-{i}" for i in range(4)]
    assert [s.prompt_index for s in specs] == [0, 0, 1, 1]  # choice i is prompt i // n's
    assert [s.prompt_token_ids for s in specs] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert [s.params.seed for s in specs] == [7, 8, 7, 8]  # choice i samples with seed + i
    assert [s.params.max_tokens for s in specs] == [16] * 4
    assert specs[0].params is submitted.params
    assert submitted.generation.n == 2 and len(submitted.generation.choices) == 4


def test_a_conversation_is_rendered_by_the_chat_template(tokenizer):
    serving = _serving(tokenizer)
    body = _chat(n=2)
    submitted = asyncio.run(serving.start(_chat_job(body)))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    specs = submitted.group.specs
    assert submitted.prompts == [prompt]
    assert [s.prompt_token_ids for s in specs] == [prompt, prompt]
    # No max_tokens and no default: the rest of the context.
    assert submitted.params.max_tokens == MAX_REQUEST_TOKENS - len(prompt)
    assert specs[1].params is specs[0].params  # unseeded choices share one params object


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": [""]}, "stop"),
        ({"priority": 1}, "priority"),  # the server runs fcfs
        ({"n": 3}, "n"),  # more choices than --max-choices-per-request 2
        ({"max_tokens": 1 << 20}, "max_tokens"),  # past the context
    ],
)
def test_the_shared_checks_refuse_before_anything_is_submitted(tokenizer, fields, param):
    serving = _serving(tokenizer, Settings(max_choices_per_request=2))
    with pytest.raises(OpenAIError) as info:
        asyncio.run(serving.start(_chat_job(_chat(**fields))))
    assert info.value.status == 400 and info.value.param == param
    assert serving.client.num_in_flight == 0


class _Text(BaseModel):
    text: str
    finish_reason: str | None


class _TextBuilder:
    """The smallest endpoint output: the choice's text and finish reason."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        raise AssertionError("not streamed")
        yield ""

    def response(self) -> _Text:
        choice = self.generation.choices[0]
        return _Text(text=choice.detokenizer.text, finish_reason=choice.finish_reason)


def test_respond_collects_the_generation_and_releases_the_group(tokenizer):
    serving = _serving(tokenizer)
    token_ids = tokenizer.encode(" Hello there", add_special_tokens=False)

    async def exchange():
        submitted = await serving.start(_chat_job(_chat(max_tokens=len(token_ids))))
        final = TokenEvent(
            "chatcmpl-t-0",
            token_ids,
            finish_reason="length",
            num_prompt_tokens=len(submitted.prompts[0]),
            num_output_tokens=len(token_ids),
        )
        asyncio.get_running_loop().call_soon(serving.client._dispatch, [final])
        builder = _TextBuilder(submitted.generation)
        return submitted, await serving.respond(submitted, builder, False, False)

    submitted, response = asyncio.run(exchange())
    assert json.loads(response.body) == {"text": " Hello there", "finish_reason": "length"}
    group = submitted.group
    assert group.released and group.settled and serving.client.num_in_flight == 0
    assert group.delivered == [len(token_ids)]
