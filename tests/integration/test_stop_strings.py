"""Stop strings and stop tokens as vLLM does them, over HTTP on the real model: a stop string
naming a special token, include_stop_str_in_output, min_tokens, skip_special_tokens. In every
case the meter bills exactly the tokens the client got: `usage.completion_tokens` equals the
number of logprobs entries returned (one per delivered token, the stop token included).

Greedy with ignore_eos, SmolLM2 answers MESSAGES in 11 tokens ("The answer to this classic
math problem is 4."), ends the answer with <|im_end|> (its chat template's end token, also
its EOS) and goes on with another turn. Each test first warms
the prefix cache, so every request compared computes the prompt the same way (bfloat16
numerics differ between a cached and a computed prompt block).
"""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
END = "<|im_end|>"
CHAT = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "logprobs": True}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0}


async def chat(client: AsyncOpenAI, **extra) -> tuple[str, str, list[str], int]:
    """text, finish_reason, the token of each logprobs entry, usage.completion_tokens"""
    max_tokens = extra.pop("max_tokens", 24)
    result = await client.chat.completions.create(
        **CHAT, max_tokens=max_tokens, extra_body={"ignore_eos": True} | extra
    )
    choice = result.choices[0]
    tokens = [entry.token for entry in choice.logprobs.content]
    return choice.message.content, choice.finish_reason, tokens, result.usage.completion_tokens


async def chat_streamed(client: AsyncOpenAI, **extra) -> tuple[str, str, list[str], int]:
    max_tokens = extra.pop("max_tokens", 24)
    stream = await client.chat.completions.create(
        **CHAT,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} | extra,
    )
    pieces, tokens, finishes, usage = [], [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.logprobs is not None and choice.logprobs.content:
                tokens += [entry.token for entry in choice.logprobs.content]
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert len(finishes) == 1 and usage is not None
    return "".join(pieces), finishes[0], tokens, usage.completion_tokens


async def completion(client: AsyncOpenAI, stream: bool, **extra) -> tuple[str, str, list, int]:
    args = COMPLETION | {"max_tokens": 24, "logprobs": 0}
    extra_body = {"ignore_eos": True} | {k: v for k, v in extra.items() if k != "stop"}
    if not stream:
        result = await client.completions.create(
            **args, stop=extra.get("stop"), extra_body=extra_body
        )
        choice = result.choices[0]
        return (
            choice.text,
            choice.finish_reason,
            choice.logprobs.tokens,
            result.usage.completion_tokens,
        )
    chunks = await client.completions.create(
        **args,
        stop=extra.get("stop"),
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra_body,
    )
    pieces, tokens, finishes, usage = [], [], [], None
    async for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert len(finishes) == 1 and usage is not None
    return "".join(pieces), finishes[0], tokens, usage.completion_tokens


@pytest.fixture(autouse=True)
async def warm_prefix_cache(openai_client: AsyncOpenAI) -> None:
    await chat(openai_client, max_tokens=1)


def completing_token(tokens: list[str], stop: str, after: int = 0) -> tuple[int, int]:
    """How many tokens it takes to complete a match of `stop` that ends past the text of
    tokens[:after], and where in the text that match starts."""
    floor = len("".join(tokens[:after]))
    for k in range(after + 1, len(tokens) + 1):
        index = "".join(tokens[:k]).find(stop, max(0, floor - len(stop) + 1))
        if index >= 0:
            return k, index
    raise AssertionError(f"{stop!r} never completes in {tokens}")


async def test_a_stop_string_naming_the_chat_templates_end_token(openai_client: AsyncOpenAI):
    _, free_finish, free_tokens, _ = await chat(openai_client)
    assert free_finish == "length" and END in free_tokens  # ignore_eos: it runs on past it
    cut = free_tokens.index(END) + 1
    answer = "".join(free_tokens[: cut - 1])
    for get in (chat, chat_streamed):
        text, finish, tokens, billed = await get(openai_client, stop=[END])
        assert (text, finish) == (answer, "stop")
        assert tokens == free_tokens[:cut] and billed == cut  # the end token is billed
        text, finish, tokens, billed = await get(
            openai_client, stop=[END], include_stop_str_in_output=True
        )
        assert (text, finish) == (answer + END, "stop") and billed == len(tokens) == cut


async def test_include_stop_str_in_output(openai_client: AsyncOpenAI):
    _, _, full_tokens, _ = await completion(openai_client, stream=False)
    full = "".join(full_tokens)
    start = len(full) // 3
    stop = full[start : start + 5]  # spans tokens: part of one token's text is cut
    assert stop.strip()
    completes, start = completing_token(full_tokens, stop)
    end = start + len(stop)
    for stream in (False, True):
        text, finish, tokens, billed = await completion(
            openai_client, stream, stop=[stop], include_stop_str_in_output=True
        )
        assert (text, finish) == (full[:end], "stop")
        assert tokens == full_tokens[:completes] and billed == completes
        text, finish, tokens, billed = await completion(openai_client, stream, stop=[stop])
        assert (text, finish) == (full[:start], "stop") and billed == completes


async def test_min_tokens_holds_a_stop_string_back(openai_client: AsyncOpenAI):
    _, _, full_tokens, _ = await chat(openai_client)
    full = "".join(full_tokens)
    first, first_start = completing_token(full_tokens, "is")  # " this"
    later, later_start = completing_token(full_tokens, "is", after=first)  # " is"
    assert later > first
    for get in (chat, chat_streamed):
        text, finish, tokens, billed = await get(openai_client, stop=["is"])
        assert (text, finish) == (full[:first_start], "stop")
        assert billed == len(tokens) == first
        text, finish, tokens, billed = await get(openai_client, stop=["is"], min_tokens=first)
        assert (text, finish) == (full[:later_start], "stop")
        assert tokens == full_tokens[:later] and billed == later


async def test_min_tokens_holds_a_special_token_stop_back(openai_client: AsyncOpenAI):
    # The end token is a stop token id for the engine, so min_tokens bans it like EOS.
    _, _, free_tokens, _ = await chat(openai_client)
    cut = free_tokens.index(END) + 1
    _, finish, tokens, billed = await chat(openai_client, stop=[END], min_tokens=cut)
    assert END not in tokens[:cut] and billed == len(tokens) > cut
    assert finish == "length" or tokens[-1] == END


async def test_skip_special_tokens_false_shows_them(openai_client: AsyncOpenAI):
    _, _, free_tokens, _ = await chat(openai_client)
    text, finish, tokens, billed = await chat(openai_client, skip_special_tokens=False)
    assert text == "".join(tokens) and END in text and billed == len(tokens)
    # The engine's stop token shows only with include_stop_str_in_output (vLLM).
    cut = free_tokens.index(END) + 1
    answer = "".join(free_tokens[: cut - 1])
    text, finish, tokens, billed = await chat(openai_client, stop=[END], skip_special_tokens=False)
    assert (text, finish, billed) == (answer, "stop", cut)
