"""One real `meterserve serve` subprocess on a free 127.0.0.1 port, shared by every test folder.

Each server runs the real default model (the embedded SmolLM2-135M GGUF) unless args say
otherwise; callers share them per session or module, because loading a model takes seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
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

    @contextmanager
    def running(self) -> Iterator[ServerProcess]:
        """Ready on entry, stopped on exit (also when it never becomes ready)."""
        try:
            self.wait_ready()
            yield self
        finally:
            self.stop()

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
