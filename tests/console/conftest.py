"""Fixtures for the console tests: one real server and headless Debian Chromium (Playwright).

The server requires an API key (the page must ask for it) and runs a step budget of 32 tokens,
so a prompt of a few dozen tokens is prefilled in several chunks: the page must light each
chunk's tokens in its own pass. Chromium is Debian's (`make chromium` installs it with
apt-get); Playwright drives it and never downloads a browser of its own. Where Chromium is
missing, the browser tests skip and say so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
# Headless, and nothing that would reach out of this closed network (Chromium's own
# connections would be refused and logged).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
API_KEY = "sk-console-test"
STEP_BUDGET = 32  # --max-num-batched-tokens: prompts longer than this are chunked


@pytest.fixture(scope="session")
def console_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        "console",
        ["--api-key", API_KEY, "--max-num-batched-tokens", str(STEP_BUDGET)],
        tmp_path_factory.mktemp("console-server-logs"),
    )
    with server.running():
        yield server


@pytest.fixture
def api(console_server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=console_server.base_url, headers=headers, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")  # closed before other modules' asyncio tests run
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(
            f"Debian's chromium is not at {CHROMIUM}: `make chromium` installs it with apt-get, "
            "which failed or is unavailable on this machine"
        )
    from playwright.sync_api import sync_playwright  # a test extra: missing it is an error

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class PageRecord:
    """Everything one page did: every request it made, every script error it logged, and the
    bodies of its streamed completions (what the API reported to it)."""

    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    completions: list[Any] = field(default_factory=list)  # playwright Response objects

    def streamed_chunks(self, index: int = -1) -> list[dict]:
        return parse_sse(self.completions[index].text())


def parse_sse(body: str) -> list[dict]:
    chunks = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


@pytest.fixture
def open_console(browser: Any, console_server: ServerProcess) -> Iterator[Any]:
    """open_console(color_scheme="light") -> (page, PageRecord): a fresh browser context on
    the console, its API key entered once in the page's own dialog."""
    contexts = []

    def open_page(color_scheme: str = "light") -> tuple[Any, PageRecord]:
        context = browser.new_context(
            viewport={"width": 1440, "height": 900}, color_scheme=color_scheme
        )
        contexts.append(context)
        page = context.new_page()
        record = PageRecord()
        page.on("request", lambda request: record.requests.append(request.url))
        page.on("pageerror", lambda error: record.errors.append(f"pageerror: {error}"))
        page.on(
            "console",
            lambda message: (
                record.errors.append(f"console.{message.type}: {message.text}")
                if message.type in ("error", "warning")
                else None
            ),
        )
        page.on(
            "response",
            lambda response: (
                record.completions.append(response)
                if response.url.endswith(("/v1/chat/completions", "/v1/completions"))
                else None
            ),
        )
        page.goto(console_server.base_url + "/")
        page.wait_for_selector("#key-dialog[open]", timeout=30_000)  # asked once, up front
        page.fill("#api-key", API_KEY)
        page.keyboard.press("Enter")
        page.wait_for_function(
            "() => document.getElementById('model-name').textContent.includes('SmolLM2')",
            timeout=60_000,
        )
        return page, record

    yield open_page
    for context in contexts:
        context.close()
