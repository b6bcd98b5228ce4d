"""Liveness: each fault injected, then what /health, /debug/engine and pending requests say.

Real servers over real HTTP: a wedged step (--debug-hang-token-id sleeps 15 s inside the model
runner) turns /health 503 `engine_stalled` and /debug/engine 503 until it clears; a crashed
engine thread (--debug-crash-token-id raises past every handler) fails the pending requests
and the process exits 1. In-process, with a fake engine thread: a thread that ends silently
turns /health 503, and a route that raises between submit() and respond() still releases
its group, so a later drain does not wait out its grace period.

Every wait has a deadline; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import Request
from server_process import ServerProcess
from serverproc import API_KEY, assert_no_leaked_blocks, wait_idle

import server.engine_client.client as engine_client_module
from engine.config import DEBUG_HANG_SECONDS
from scheduler.output import TokenEvent
from scheduler.sampling_params import SamplingParams
from server.app import create_app
from server.app_state import billing_account, ready_client
from server.engine_client.client import EngineClient
from server.engine_client.commands import Abort, Command, Snapshot, Stop
from server.engine_client.loop import LoopSide
from server.engine_client.request_group import EngineRequestSpec, RequestGroup
from server.http.errors import OpenAIError
from server.settings import Settings

MODEL = "SmolLM2-135M-Instruct"
# Special tokens of the default model that no normal prompt or completion contains
# (13 is the shared server's --debug-fault-token-id).
HANG_TOKEN_ID = 14  # <jupyter_output>
CRASH_TOKEN_ID = 15  # <empty_output>
STALL_TIMEOUT_S = 2
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def wedge_server(server_logs: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        "wedge",
        ["--api-key", API_KEY, "--engine-stall-timeout", str(STALL_TIMEOUT_S),
         "--debug-hang-token-id", str(HANG_TOKEN_ID)],
        server_logs,
    )  # fmt: skip
    with server.running():
        yield server


@pytest.fixture(scope="module")
def crash_server(server_logs: Path) -> Iterator[ServerProcess]:
    """The crash test's server, launched without waiting for it: the wedged-step test asks
    for it too, so that its model loads while the wedged step sleeps (its idle ~15 s)."""
    server = ServerProcess("crash", ["--debug-crash-token-id", str(CRASH_TOKEN_ID)], server_logs)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def wedge_http(wedge_server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=wedge_server.base_url, headers=AUTH, timeout=120) as c:
        yield c


async def _prompt_ids(http: httpx.AsyncClient, text: str) -> list[int]:
    response = await http.post("/tokenize", json={"prompt": text})
    response.raise_for_status()
    return response.json()["tokens"]


async def _wait_for(probe, what: str, timeout: float):
    """Poll `probe()` (a coroutine function returning a value or None) until it answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await probe()
        if value is not None:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not seen within {timeout} s")


# ---- (d) /debug/engine sits behind the API key ----------------------------------------------


async def test_debug_engine_needs_the_api_key(wedge_server: ServerProcess):
    async with httpx.AsyncClient(base_url=wedge_server.base_url, timeout=60) as anonymous:
        refused = await anonymous.get("/debug/engine")
        wrong = await anonymous.get("/debug/engine", headers={"Authorization": "Bearer nope"})
        health = await anonymous.get("/health")  # probes need no key
        answered = await anonymous.get("/debug/engine", headers=AUTH)
    for response in (refused, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200
    assert answered.status_code == 200 and answered.json()["num_blocks"] > 0


# ---- (a) + (d) a wedged step ------------------------------------------------------------------


async def test_wedged_step_reports_stalled_until_it_clears(
    wedge_http: httpx.AsyncClient,
    crash_server: ServerProcess,
    overload_server_launched: ServerProcess,
    ngram_server_launched: ServerProcess,
    draft_model_server_launched: ServerProcess,
):
    # The four servers asked for are only launched: their models load while the step hangs.
    assert (await wedge_http.get("/health")).status_code == 200
    hung_prompt = await _prompt_ids(wedge_http, "Hello there") + [HANG_TOKEN_ID]
    body = {"model": MODEL, "prompt": hung_prompt, "max_tokens": 4, "ignore_eos": True}
    pending = asyncio.create_task(wedge_http.post("/v1/completions", json=body))
    try:

        async def stalled() -> dict | None:
            response = await wedge_http.get("/health")
            if response.status_code == 503 and response.json()["status"] == "stalled":
                return response.json()
            return None

        # The hang lasts DEBUG_HANG_SECONDS; the stall shows STALL_TIMEOUT_S into it.
        health = await _wait_for(stalled, "/health engine_stalled", DEBUG_HANG_SECONDS - 5)
        assert health["error"]["code"] == "engine_stalled"
        assert health["error"]["type"] == "service_unavailable_error"
        assert health["num_pending_requests"] == 1
        assert health["seconds_since_last_step"] > STALL_TIMEOUT_S
        assert "has not finished a step" in health["error"]["message"]

        # The wedged thread cannot answer a snapshot: 503 instead of hanging with it.
        debug = await wedge_http.get("/debug/engine")
        assert debug.status_code == 503, debug.text
        assert debug.json()["error"]["code"] == "engine_unresponsive"
        assert "did not answer" in debug.json()["error"]["message"]

        # The hang clears: the request completes, /health is 200 again, the thread (which
        # dropped the abandoned snapshot) answers, and no block leaked.
        done = await asyncio.wait_for(pending, timeout=DEBUG_HANG_SECONDS + 90)
    finally:
        pending.cancel()
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 4

    async def healthy() -> bool | None:
        return True if (await wedge_http.get("/health")).status_code == 200 else None

    await _wait_for(healthy, "/health 200 after the hang", 60)
    assert_no_leaked_blocks(await wait_idle(wedge_http, timeout=60))


# ---- (b) the engine thread dies ---------------------------------------------------------------


async def test_engine_thread_death_fails_pending_requests(crash_server: ServerProcess):
    server = crash_server
    try:
        await asyncio.to_thread(server.wait_ready)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            crash_prompt = await _prompt_ids(http, "Hello there") + [CRASH_TOKEN_ID]
            long_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
                         "ignore_eos": True, "stream": True}  # fmt: skip
            async with http.stream("POST", "/v1/completions", json=long_body) as stream:
                lines = stream.aiter_lines()
                assert (await asyncio.wait_for(anext(lines), 60)).startswith("data: {")
                crash = await http.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": crash_prompt, "max_tokens": 4},
                )
                rest = await asyncio.wait_for(_data_lines(lines), 60)
            assert crash.status_code == 500, crash.text
            error = crash.json()["error"]
            assert error["code"] == "engine_dead" and "engine loop crashed" in error["message"]
            # The stream that was mid-generation ends with an error event, then [DONE].
            assert rest[-1] == "data: [DONE]"
            assert '"code":"engine_dead"' in rest[-2]

            # Until the process is gone, every answer /health gives is 503 "dead".
            while server.proc.poll() is None:
                try:
                    health = await http.get("/health", timeout=5)
                except httpx.HTTPError:
                    break  # the server is shutting down
                assert health.status_code == 503 and health.json()["status"] == "dead"
                await asyncio.sleep(0.1)
        assert await asyncio.to_thread(server.wait_exit, 60) == 1
        assert "engine loop crashed" in server.log_tail(200)
    finally:
        server.stop()


async def _data_lines(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines if line.startswith("data: ")]


# ---- in process, with a fake engine thread ----------------------------------------------------

_FAKE_CORE = SimpleNamespace(
    tokenizer=[0] * 100,
    model_name="fake",
    max_model_len=256,
    kv_cache_info=SimpleNamespace(max_tokens=256, num_blocks=16, block_size=16),
    model_shape=SimpleNamespace(vocab_size=100),
)


class FakeEngineLoop:
    """Stands in for server.engine_client.loop.EngineLoop without a model: reports ready, then
    acknowledges each abort with a final event as the real thread does."""

    exit_after_ready = False

    def __init__(self, engine_config, meter_config, metrics_factory, commands, side) -> None:
        self.commands: queue.SimpleQueue[Command] = commands
        self.side: LoopSide = side
        self.heartbeat = time.monotonic()

    def run(self) -> None:
        self.side.post(self.side.on_ready, _FAKE_CORE, None)
        if self.exit_after_ready:
            return  # a thread that vanishes without a word (the real one always reports)
        while True:
            command = self.commands.get(timeout=120)  # bounded: a forgotten fake ends
            if isinstance(command, Stop):
                return
            if isinstance(command, Abort):
                final = TokenEvent(command.request_id, [], finish_reason="abort")
                self.side.post(self.side.dispatch, [final])
            elif isinstance(command, Snapshot) and command.future.set_running_or_notify_cancel():
                command.future.set_result({})
            self.heartbeat = time.monotonic()


class VanishingEngineLoop(FakeEngineLoop):
    exit_after_ready = True


async def _started(app, monkeypatch: pytest.MonkeyPatch, fake: type) -> EngineClient:
    monkeypatch.setattr(engine_client_module, "EngineLoop", fake)
    client: EngineClient = app.state.engine_client
    client.start()
    async with asyncio.timeout(30):
        await client.wait_ready()
    return client


def _asgi(app) -> httpx.AsyncClient:
    # raise_app_exceptions=False: an unhandled error is the 500 response a client would see.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)


async def test_health_is_503_when_the_engine_thread_has_ended(monkeypatch: pytest.MonkeyPatch):
    app = create_app(Settings())
    client = await _started(app, monkeypatch, VanishingEngineLoop)
    try:
        async with _asgi(app) as http:

            async def dead() -> dict | None:
                response = await http.get("/health")
                return response.json() if response.status_code == 503 else None

            body = await _wait_for(dead, "/health 503", 30)
        assert body["status"] == "dead" and body["error"]["code"] == "server_dead"
        assert "the engine thread has exited" in body["error"]["message"]
        assert client.liveness().dead
    finally:
        await client.shutdown()


class _RouteBug(Exception):
    pass


@pytest.mark.parametrize(
    ("raised", "status"),
    [(_RouteBug("a bug between submit and respond"), 500),
     (OpenAIError(400, "a late validation error"), 400)],
)  # fmt: skip
async def test_route_raising_after_submit_still_releases_its_group(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, status: int
):
    app = create_app(Settings())
    submitted: list[RequestGroup] = []

    @app.post("/test/submit-then-raise")
    async def submit_then_raise(request: Request) -> None:
        client = ready_client(request)
        spec = EngineRequestSpec("fake-0", [1, 2, 3], SamplingParams())
        submitted.append(client.submit([spec], billing_account(request)))
        raise raised

    client = await _started(app, monkeypatch, FakeEngineLoop)
    try:
        async with _asgi(app) as http:
            response = await http.post("/test/submit-then-raise")
        assert response.status_code == status
        assert response.json()["error"]["message"]
        (group,) = submitted
        assert group.released and client.num_in_flight == 0
        # Nothing in flight: a drain with an hour's grace period returns at once (the test's
        # own deadline is what would fail if it waited).
        async with asyncio.timeout(30):
            await client.drain(grace_period=3600)

        async def settled() -> bool | None:
            return True if group.settled else None  # the abort's acknowledgement came back

        await _wait_for(settled, "the group's settlement", 30)
    finally:
        await client.shutdown()
