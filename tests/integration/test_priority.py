"""The `priority` request field reaches the scheduler: with one request running at a time,
of two that wait, the one with the lower priority value is served first."""

from __future__ import annotations

import asyncio

import httpx
from server_process import ServerProcess
from serverproc import API_KEY

MODEL = "SmolLM2-135M-Instruct"


async def _complete(client: httpx.AsyncClient, priority: int, max_tokens: int) -> float:
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "priority": priority}  # fmt: skip
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return asyncio.get_running_loop().time()


async def test_lower_priority_value_runs_first(priority_server: ServerProcess):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(
        base_url=priority_server.base_url, headers=headers, timeout=120
    ) as client:
        # Occupy the single running slot long enough for both others to queue behind it.
        blocker = asyncio.ensure_future(_complete(client, 0, 400))
        await _wait_running(client)
        late = asyncio.ensure_future(_complete(client, 10, 4))
        await _wait_waiting(client, 1)
        urgent = asyncio.ensure_future(_complete(client, -10, 4))
        await _wait_waiting(client, 2)
        _, done_late, done_urgent = await asyncio.gather(blocker, late, urgent)
    assert done_urgent < done_late  # queued second, served first


async def _engine(client: httpx.AsyncClient) -> dict:
    response = await client.get("/debug/engine")
    response.raise_for_status()
    return response.json()


async def _wait_running(client: httpx.AsyncClient) -> None:
    await _until(client, lambda info: info["num_running"] >= 1)


async def _wait_waiting(client: httpx.AsyncClient, count: int) -> None:
    await _until(client, lambda info: info["num_waiting"] >= count)


async def _until(client: httpx.AsyncClient, condition) -> None:
    deadline = asyncio.get_running_loop().time() + 60
    while not condition(await _engine(client)):
        assert asyncio.get_running_loop().time() < deadline, "the engine never got there"
        await asyncio.sleep(0.01)
