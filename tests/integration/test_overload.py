"""Overload on a small server: queue-full 429 with Retry-After, request timeouts, and a drain
whose grace period runs out (SIGTERM ends the in-flight request with an error, exit code 0).

The server runs one request at a time (--max-num-seqs 1) and queues at most two.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from server_process import ServerProcess
from serverproc import assert_no_leaked_blocks, metric_value, wait_idle

MODEL = "SmolLM2-135M-Instruct"
# Longer than any of these tests waits: 5,000 tokens take ~22 s even at a quiet single-stream
# speed of ~230 tok/s (2,000 tokens once finished inside the server's 12 s --request-timeout,
# serverproc.OVERLOAD_TIMEOUT_S, when the thread governor gave the request a free core). Not
# more: a float32 KV cache (CPUs without bf16) holds ~5,800.
LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 5000, "ignore_eos": True}


@pytest.fixture(scope="module")
def overload_server(overload_server_launched: ServerProcess) -> Iterator[ServerProcess]:
    """serverproc.OVERLOAD_ARGS, launched early (conftest); stopped at this module's end."""
    with overload_server_launched.running() as server:
        yield server


@pytest.fixture
async def http(overload_server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=overload_server.base_url, timeout=60) as client:
        yield client


async def after_first_data(response: httpx.Response) -> AsyncIterator[str]:
    """The response's line iterator, advanced past its first data line. Keep it referenced:
    a line iterator that is garbage-collected closes the response (a disconnect)."""
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            return lines
    raise AssertionError("stream ended without data")


async def wait_queued(http: httpx.AsyncClient, num_queued: int, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while (await http.get("/debug/engine")).json()["num_queued"] < num_queued:
            await asyncio.sleep(0.05)


async def test_queue_full_gets_429_with_retry_after(http: httpx.AsyncClient):
    async with contextlib.AsyncExitStack() as stack:
        running = await stack.enter_async_context(
            http.stream("POST", "/v1/completions", json=LONG | {"stream": True})
        )
        lines = await after_first_data(running)  # it holds the only running slot now
        for _ in range(2):
            await stack.enter_async_context(
                http.stream("POST", "/v1/completions", json=LONG | {"stream": True})
            )
        await wait_queued(http, 2)
        refused = await http.post("/v1/completions", json=LONG | {"max_tokens": 4})
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert "2 requests are waiting" in error["message"]
        del lines
    # Leaving the block disconnected the three streams: everything is aborted and freed.
    assert_no_leaked_blocks(await wait_idle(http))
    assert await metric_value(http, "meterserve_request_rejections_total", reason="queue_full") >= 1


async def test_request_timeout(http: httpx.AsyncClient, priority_server_launched: ServerProcess):
    # The priority server (conftest) is only launched: it loads while these requests time out.
    async def streamed() -> list[str]:
        async with http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
            return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

    # The second request waits behind the first; both run out of time.
    whole, events = await asyncio.gather(http.post("/v1/completions", json=LONG), streamed())
    assert whole.status_code == 408
    assert whole.json()["error"]["code"] == "request_timeout"
    assert "timed out" in whole.json()["error"]["message"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert_no_leaked_blocks(await wait_idle(http))
    assert await metric_value(http, "meterserve_request_rejections_total", reason="timeout") >= 2


async def test_sigterm_grace_period_elapses(overload_server: ServerProcess, http):
    async with http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
        lines = await after_first_data(r)
        overload_server.signal()
        await asyncio.sleep(0.5)
        assert overload_server.proc.poll() is None, overload_server.log_tail()
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = await http.post("/v1/completions", json=LONG | {"max_tokens": 2})
        assert refused.status_code == 503
        events = [line[6:] async for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and "grace period" in error["message"]
    assert await asyncio.to_thread(overload_server.wait_exit, 30) == 0
