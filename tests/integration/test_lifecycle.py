"""Server lifecycle: SIGTERM drains (new requests and /health get 503, the in-flight request
finishes whole, exit code 0); a model that cannot load ends the process with code 1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
# Long enough that the request is still running well after SIGTERM + 0.3 s (≈ 15 ms a token
# on the development machine; a 12-token request used to finish before /health was asked).
IN_FLIGHT_TOKENS = 300


async def test_sigterm_finishes_in_flight_then_exits(server_logs: Path):
    server = ServerProcess("drain", ["--drain-grace-period", "120"], server_logs)
    try:
        await asyncio.to_thread(server.wait_ready)
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": IN_FLIGHT_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with (
            httpx.AsyncClient(base_url=server.base_url, timeout=120) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            server.signal()
            await asyncio.sleep(0.3)
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = await http.post("/v1/completions", json=body | {"stream": False})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable_error"
            rest = [line[6:] async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(data) for data in rest[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == IN_FLIGHT_TOKENS
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert await asyncio.to_thread(server.wait_exit, 60) == 0
    finally:
        server.stop()


async def test_missing_model_exits_with_code_1(server_logs: Path, tmp_path: Path):
    missing = tmp_path / "no-such-model"
    server = ServerProcess("missing-model", ["--model", str(missing)], server_logs)
    try:
        code = await asyncio.to_thread(server.wait_exit, 120)
        assert code == 1, server.log_tail()
        assert f"model path does not exist: {missing}" in server.log_tail()
    finally:
        server.stop()
