"""Fixtures: the shared real server and clients for it (see serverproc.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from server_process import ServerProcess
from serverproc import API_KEY, DRAFT_MODEL_SPEC, FAULT_TOKEN_ID, NGRAM_SPEC, OVERLOAD_ARGS


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def main_server(server_logs: Path) -> Iterator[ServerProcess]:
    """The shared server: API key required, fault injection armed, defaults otherwise."""
    server = ServerProcess(
        "main",
        ["--api-key", API_KEY, "--debug-fault-token-id", str(FAULT_TOKEN_ID)],
        server_logs,
    )
    with server.running():
        yield server


@pytest.fixture(scope="session")
def priority_server(priority_server_launched: ServerProcess) -> ServerProcess:
    """A second server: priority scheduling, one request at a time, no fault injection armed
    (the fuzzer must not hit the injected fault, a 500 by design)."""
    priority_server_launched.wait_ready()
    return priority_server_launched


# Launched, not waited for: the fixture or module that uses one waits for it (wait_ready, or
# ServerProcess.running, which also stops it at the module's end). Tests that leave the cores
# idle, or busy with work whose speed they do not depend on, ask for them earlier so that their
# models load meanwhile: test_liveness's wedged step (its engine sleeps ~15 s) and
# test_overload's request timeout (12 s, whatever the decode speed).


def _launched(name: str, args: list[str], server_logs: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(name, args, server_logs)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def priority_server_launched(server_logs: Path) -> Iterator[ServerProcess]:
    args = ["--api-key", API_KEY, "--scheduling-policy", "priority", "--max-num-seqs", "1"]
    yield from _launched("priority", args, server_logs)


@pytest.fixture(scope="session")
def overload_server_launched(server_logs: Path) -> Iterator[ServerProcess]:
    yield from _launched("overload", OVERLOAD_ARGS, server_logs)


@pytest.fixture(scope="session")
def ngram_server_launched(server_logs: Path) -> Iterator[ServerProcess]:
    yield from _launched("ngram", ["--speculative-config", json.dumps(NGRAM_SPEC)], server_logs)


@pytest.fixture
def openai_client(main_server: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=main_server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
async def http(main_server: ServerProcess):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=main_server.base_url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def draft_model_server_launched(server_logs: Path) -> Iterator[ServerProcess]:
    spec = json.dumps(DRAFT_MODEL_SPEC)
    yield from _launched("draft-model", ["--speculative-config", spec], server_logs)
