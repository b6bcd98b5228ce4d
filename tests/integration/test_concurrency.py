"""64 concurrent streaming clients: all finish with the right token counts, in shared batches."""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI
from serverproc import assert_no_leaked_blocks, engine_info, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 16


async def one_client(client: AsyncOpenAI, i: int) -> tuple[int, str, int]:
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finish, completion_tokens, num_chunks = None, -1, 0
    async for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            num_chunks += 1
            finish = choice.finish_reason or finish
    return completion_tokens, finish, num_chunks


async def test_64_concurrent_streams(main_server, http: httpx.AsyncClient):
    before = await engine_info(http)
    client = AsyncOpenAI(
        base_url=main_server.base_url + "/v1",
        api_key="sk-meterserve-test",
        max_retries=0,
        timeout=240,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=NUM_CLIENTS)),
    )
    results = await asyncio.gather(*(one_client(client, i) for i in range(NUM_CLIENTS)))
    for completion_tokens, finish, num_chunks in results:
        assert completion_tokens == MAX_TOKENS
        assert finish == "length"
        assert num_chunks >= 2  # the role chunk, then content as it was generated
    info = await wait_idle(http)
    assert info["max_running_batch_observed"] > 1, info
    # The 64 requests ran side by side, not one after another.
    assert info["max_running_batch_observed"] >= min(NUM_CLIENTS // 4, 16), (before, info)
    assert_no_leaked_blocks(info)
