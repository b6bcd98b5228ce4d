"""Helpers for the integration tests: `meterserve serve` subprocesses on 127.0.0.1.

Each server runs the real default model (the embedded SmolLM2-135M GGUF) on a free port and is
shared per session or module, because loading a model takes seconds. Tests talk to it over
real HTTP with the official `openai` client or httpx, and read /debug/engine to check that
the block pool leaked nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-meterserve-test"
# <jupyter_code>: a special token no chat prompt or normal completion contains. A step holding
# it fails inside the model runner (EngineConfig.debug_fault_token_id).
FAULT_TOKEN_ID = 13
# Small KV cache: several servers may run at once on a small machine.
COMMON_ARGS = ["--kv-cache-bytes", "256MiB"]
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `meterserve serve` subprocess and its log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        command = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), *COMMON_ARGS, *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("METERSERVE_")}
        if "METERSERVE_CACHE_DIR" in os.environ:
            env["METERSERVE_CACHE_DIR"] = os.environ["METERSERVE_CACHE_DIR"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"server {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        pytest.fail(f"server {self.name} not ready after {timeout} s:\n{self.log_tail()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, num_lines: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])


async def engine_info(http: httpx.AsyncClient) -> dict:
    response = await http.get("/debug/engine")
    response.raise_for_status()
    return response.json()


async def wait_idle(http: httpx.AsyncClient, timeout: float = 30.0) -> dict:
    """Poll /debug/engine until nothing is in flight; return the idle snapshot."""
    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        info = await engine_info(http)
        busy = info["num_running"] + info["num_waiting"] + info["num_in_flight_http_requests"]
        if busy == 0:
            return info
        await asyncio.sleep(0.1)
    raise AssertionError(f"engine still busy after {timeout} s: {info}")


def assert_no_leaked_blocks(info: dict) -> None:
    assert info["invariants_ok"], info["invariants_error"]
    assert info["num_free_blocks"] == info["num_blocks"], info
    assert info["num_queued"] == 0 and info["queued_tokens"] == 0, info


async def metric_value(http: httpx.AsyncClient, name: str, **labels: str) -> float:
    """One sample's value from /metrics (0.0 when absent)."""
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
