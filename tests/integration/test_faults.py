"""Faults on the shared server: a client disconnecting mid-stream, a model step that raises."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from serverproc import FAULT_TOKEN_ID, assert_no_leaked_blocks, metric_value, wait_idle

MODEL = "SmolLM2-135M-Instruct"


async def test_disconnect_mid_stream_frees_blocks(http: httpx.AsyncClient):
    aborted_before = await metric_value(http, "meterserve_requests_total", finished_reason="abort")
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 3:
                    break  # leaving the block closes the connection mid-stream
    assert chunks == 3
    info = await wait_idle(http, timeout=30)
    assert_no_leaked_blocks(info)
    aborted_after = await metric_value(http, "meterserve_requests_total", finished_reason="abort")
    assert aborted_after == aborted_before + 1


async def test_disconnect_before_response_frees_blocks(http: httpx.AsyncClient):
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    request = asyncio.create_task(http.post("/v1/completions", json=body))
    await asyncio.sleep(1.0)
    request.cancel()  # closes the connection while the server is generating
    with pytest.raises(asyncio.CancelledError):
        await request
    assert_no_leaked_blocks(await wait_idle(http, timeout=30))


async def test_model_fault_fails_only_its_request(
    http: httpx.AsyncClient, openai_client: AsyncOpenAI
):
    prompt_ids = (await http.post("/tokenize", json={"prompt": "Hello there"})).json()["tokens"]
    faulty_prompt = prompt_ids + [FAULT_TOKEN_ID]

    async def healthy() -> object:
        return await openai_client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True}
        )

    # The faulty request arrives while a healthy stream is mid-generation, so both share
    # steps; the engine re-runs the failed step per request and fails only the faulty one.
    stream = await openai_client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = aiter(stream)
    first = await anext(chunks)
    assert first.choices[0].text is not None
    bad = await http.post(
        "/v1/completions", json={"model": MODEL, "prompt": faulty_prompt, "max_tokens": 8}
    )
    rest = [chunk async for chunk in chunks]
    assert rest[-1].usage.completion_tokens == 16
    assert rest[-2].choices[0].finish_reason == "length"
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert "model step failed" in error["message"] and error["type"] == "server_error"

    # Streamed: the failure arrives as an error event, which the openai client raises.
    with pytest.raises(openai.APIError, match="model step failed"):
        failing = await openai_client.completions.create(
            model=MODEL, prompt=faulty_prompt, max_tokens=8, stream=True
        )
        async for _ in failing:
            pass

    async with http.stream(
        "POST",
        "/v1/completions",
        json={"model": MODEL, "prompt": faulty_prompt, "max_tokens": 8, "stream": True},
    ) as response:
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"

    # The server keeps serving, and the failed requests' blocks went back to the pool.
    after = await healthy()
    assert after.usage.completion_tokens == 12
    assert_no_leaked_blocks(await wait_idle(http))
    assert await metric_value(http, "meterserve_requests_total", finished_reason="error") >= 3
