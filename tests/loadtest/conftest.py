"""Fixtures: real `meterserve serve` processes (loadtest_server.Server) with the default model.

Both servers start together at the first test that needs one (loading the model takes
seconds each) and stop at the end of the session.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from loadtest_server import Server


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    log_dir = tmp_path_factory.mktemp("loadtest-servers")
    started = {
        "main": Server("main", [], log_dir),
        # One queued request at most: a burst of users must get 429s.
        "tiny_queue": Server("tiny_queue", ["--max-waiting-requests", "1"], log_dir),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="session")
def main_server(servers: dict[str, Server]) -> Server:
    return servers["main"]


@pytest.fixture(scope="session")
def tiny_queue_server(servers: dict[str, Server]) -> Server:
    return servers["tiny_queue"]
