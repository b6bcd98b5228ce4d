"""Server: one real `meterserve serve` process for the load tests, quiet logs
(a module of its own, not conftest, so test files can import it by a unique name)."""

from __future__ import annotations

from pathlib import Path

from server_process import REPO, ServerProcess

__all__ = ["REPO", "Server"]


class Server(ServerProcess):
    """The shared server process, logging warnings only (locust runs make many requests)."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        super().__init__(name, [*args, "--log-level", "warning"], log_dir)
