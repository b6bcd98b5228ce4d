"""The OpenAI API through the official `openai` client against the real server and model.

Greedy comparisons warm the prefix cache first, so the two requests compared are computed
identically (both find the same cached prompt blocks); bfloat16 numerics then cannot make
them differ.
"""

from __future__ import annotations

import math

import httpx
from openai import AsyncOpenAI
from serverproc import assert_no_leaked_blocks, wait_idle

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
LENGTH = {"ignore_eos": True}  # extra_body: always generate exactly max_tokens


async def stream_completion_text(client: AsyncOpenAI, **kwargs) -> tuple[str, list, object]:
    stream = await client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    pieces, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return "".join(pieces), finishes, usage


async def stream_chat_text(client: AsyncOpenAI, **kwargs) -> tuple[str, list, object]:
    stream = await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    pieces, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return "".join(pieces), finishes, usage


async def count_tokens(http: httpx.AsyncClient, **body) -> int:
    response = await http.post("/tokenize", json=body)
    response.raise_for_status()
    return response.json()["count"]


async def test_models_health_version(http: httpx.AsyncClient, openai_client: AsyncOpenAI):
    models = await openai_client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert (await http.get("/health")).json() == {"status": "ok"}
    assert (await http.get("/version")).json()["version"]


async def test_completion_usage_is_exact(http: httpx.AsyncClient, openai_client: AsyncOpenAI):
    result = await openai_client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body=LENGTH,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length" and choice.text
    prompt_tokens = await count_tokens(http, prompt=PROMPT)
    assert result.usage.prompt_tokens == prompt_tokens == 5
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == prompt_tokens + 12
    # The completion's own tokens re-tokenize to at most as many tokens as were generated.
    assert 0 < await count_tokens(http, prompt=choice.text, add_special_tokens=False) <= 12
    extra = result.usage.model_extra
    assert extra["cost_usd"] > 0 and extra["time_to_first_token_seconds"] > 0


async def test_completion_stream_equals_non_stream(openai_client: AsyncOpenAI):
    args = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    await openai_client.completions.create(**(args | {"max_tokens": 1}))  # warm the prefix cache
    whole = await openai_client.completions.create(**args)
    streamed, finishes, usage = await stream_completion_text(openai_client, **args)
    assert streamed == whole.choices[0].text
    assert finishes == [whole.choices[0].finish_reason]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens == 5


async def test_chat_stream_equals_non_stream(http: httpx.AsyncClient, openai_client: AsyncOpenAI):
    args = {
        "model": "SmolLM2-135M-Instruct",
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 0,
    }
    await openai_client.chat.completions.create(**(args | {"max_tokens": 1}))  # warm the cache
    whole = await openai_client.chat.completions.create(**args)
    streamed, finishes, usage = await stream_chat_text(openai_client, **args)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content
    assert streamed == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    prompt_tokens = await count_tokens(http, messages=MESSAGES)
    assert whole.usage.prompt_tokens == usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    # The third identical request found the prompt's full blocks in the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens >= 16


async def test_chat_usage_counts_length(openai_client: AsyncOpenAI):
    result = await openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_completion_tokens=9,
        extra_body=LENGTH,
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 9
    assert result.usage.total_tokens == result.usage.prompt_tokens + 9


async def test_n_choices(openai_client: AsyncOpenAI):
    result = await openai_client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Once upon a time",
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body=LENGTH,
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in result.choices)
    assert result.usage.completion_tokens == 16
    assert result.usage.prompt_tokens == 4  # the shared prompt counts once
    chat = await openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        extra_body=LENGTH,
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 12


async def test_n_choices_streamed(openai_client: AsyncOpenAI):
    stream = await openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        stream=True,
        extra_body=LENGTH,
    )
    finished = {}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}


async def test_seed_reproducible(openai_client: AsyncOpenAI):
    args = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Random words:",
        "max_tokens": 8,
        "temperature": 1.5,
        "extra_body": LENGTH,
    }
    first = await openai_client.completions.create(seed=1234, **args)
    second = await openai_client.completions.create(seed=1234, **args)
    other = await openai_client.completions.create(seed=98765, **args)
    assert first.choices[0].text == second.choices[0].text
    # 8 tokens sampled at temperature 1.5 with another seed: equal only by a fluke.
    assert other.choices[0].text != first.choices[0].text


async def test_completion_logprobs(openai_client: AsyncOpenAI):
    result = await openai_client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body=LENGTH,
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)


async def test_chat_logprobs(openai_client: AsyncOpenAI):
    result = await openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=LENGTH,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)
        assert bytes(entry.bytes).decode("utf-8", errors="replace")


async def test_stop_string_cuts_across_tokens(openai_client: AsyncOpenAI):
    args = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    full = (await openai_client.completions.create(**args)).choices[0].text
    # A stop string that starts mid-text and spans more than one token's text.
    start = len(full) // 3
    stop = full[start : start + 6]
    assert len(stop) == 6 and stop.strip()
    expected = full[: full.index(stop)]
    result = await openai_client.completions.create(stop=[stop, "never-seen-@@"], **args)
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens < 16
    streamed, finishes, usage = await stream_completion_text(openai_client, stop=stop, **args)
    assert streamed == expected and finishes == ["stop"]
    assert usage.completion_tokens == result.usage.completion_tokens


async def test_echo_and_token_prompts(http: httpx.AsyncClient, openai_client: AsyncOpenAI):
    echoed = await openai_client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith(PROMPT)
    ids = (await http.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
    by_ids = await openai_client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=4, temperature=0
    )
    assert PROMPT + by_ids.choices[0].text == echoed.choices[0].text
    detok = (await http.post("/detokenize", json={"tokens": ids})).json()
    assert detok["prompt"] == PROMPT
    batch = await openai_client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=[PROMPT, "Hello"], max_tokens=3, extra_body=LENGTH
    )
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert batch.usage.completion_tokens == 6
    assert batch.usage.prompt_tokens == 5 + await count_tokens(http, prompt="Hello")


async def test_no_leaked_blocks_after_api_tests(http: httpx.AsyncClient):
    assert_no_leaked_blocks(await wait_idle(http))
