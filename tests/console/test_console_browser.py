"""The web console in a real browser (headless Debian Chromium, driven by Playwright) against
the real server: the page's counters equal what the API streamed to it for the same request,
the live batch view sees two tabs' runs share steps, nothing leaves the server's origin, and
the page logs no script errors. Screenshots are saved under pytest's tmp dir (paths printed).

No timing asserts: every wait is for a condition, under a generous deadline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

RUN_DEADLINE_MS = 240_000
TWO_TAB_TOKENS = 1024
# About 90 prompt tokens with the chat template: several prefill chunks under the server's
# step budget (conftest.STEP_BUDGET), even when the template's system prompt is cached.
LONG_PROMPT = (
    "You are looking at a web console that meters an inference server. Describe, in plain "
    "words and in the order they happen, what prefill and decode passes do for a request like "
    "this one, why the first token waits for the whole prompt, and why every later token costs "
    "one more forward pass over the model's weights."
)
COUNTERS_JS = """() => Object.fromEntries(
    [...document.querySelectorAll('output[id^="c-"]')].map(o => [o.id.slice(2), o.dataset.value]))"""


def wait_for_run(page: Any, state: str = "done") -> None:
    status = "#run-status"
    page.wait_for_selector(
        f'{status}[data-state="{state}"], {status}[data-state="error"]', timeout=RUN_DEADLINE_MS
    )
    assert page.get_attribute(status, "data-state") == state, page.inner_text(status)


def start_run(page: Any, prompt: str, max_tokens: int, mode: str = "chat") -> None:
    page.check(f'input[name="mode"][value="{mode}"]')
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.check("#ignore-eos")
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")  # the keyboard shortcut is the way to run


def assert_clean(record: Any, base_url: str) -> None:
    outside = [url for url in record.requests if not url.startswith(base_url + "/")]
    assert not outside, f"requests left the server's origin: {outside}"
    assert not record.errors, record.errors


def screenshot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
    print(f"console screenshot: {path}")


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_a_run_shows_the_passes_and_the_bill_the_api_streamed(
    open_console, console_server, tmp_path, mode
):
    page, record = open_console()
    start_run(page, LONG_PROMPT, max_tokens=24, mode=mode)
    wait_for_run(page)

    # What the API reported for this very request: the stream the page received.
    [response] = record.completions
    assert response.status == 200
    chunks = record.streamed_chunks()
    usage = chunks[-1]["usage"]
    progress = [chunk["meterserve"] for chunk in chunks if "meterserve" in chunk]
    prefill_passes = {p["forward_pass"] for p in progress if p["phase"] == "prefill"}
    decode_passes = {p["forward_pass"] for p in progress if p["phase"] == "decode"}
    producing = [p for p in progress if p["token_ids"]]
    # The stream's own story: chunked prefill (progress-only chunks with no choices), the
    # last prefill chunk's pass makes the first token, then one decode pass per token.
    assert len(prefill_passes) >= 2, progress[:3]
    for chunk in chunks:
        if "meterserve" in chunk and not chunk["meterserve"]["token_ids"]:
            assert chunk["choices"] == [] and chunk["meterserve"]["phase"] == "prefill"
    assert producing[0]["phase"] == "prefill"
    assert [p["phase"] for p in producing[1:]] == ["decode"] * (len(producing) - 1)
    assert usage["completion_tokens"] == 24 == len(producing)
    assert len(decode_passes) == usage["completion_tokens"] - 1

    # The page's counters equal it.
    shown = page.evaluate(COUNTERS_JS)
    assert int(shown["prefill-passes"]) == len(prefill_passes)
    assert int(shown["decode-passes"]) == len(decode_passes)
    assert int(shown["forward-passes"]) == len(prefill_passes | decode_passes)
    assert float(shown["tokens-per-pass"]) == 1.0  # no speculative decoding on this server
    assert all(p["draft_tokens"] == p["accepted_draft_tokens"] == 0 for p in progress)
    assert int(shown["prompt-tokens"]) == usage["prompt_tokens"]
    assert int(shown["completion-tokens"]) == usage["completion_tokens"]
    assert float(shown["cost"]) == usage["cost_usd"]
    assert float(shown["cost-prefill"]) == usage["prefill_cost_usd"]
    assert float(shown["cost-decode"]) == usage["decode_cost_usd"]
    assert float(shown["flops-prefill"]) == usage["prefill_flops"]
    assert float(shown["flops-decode"]) == usage["decode_flops"]
    assert float(shown["ttft"]) == usage["time_to_first_token_seconds"]
    times = [p["elapsed_seconds"] for p in producing]
    assert float(shown["itl"]) == pytest.approx((times[-1] - times[0]) / (len(times) - 1))
    assert float(shown["tps"]) == pytest.approx(len(times) / times[-1])

    # Every prompt token is shown, and lit by its pass; one answer token per producing pass.
    assert page.locator("#prompt-tokens .tok").count() == usage["prompt_tokens"]
    assert page.locator("#prompt-tokens .tok.pending").count() == 0
    assert page.locator("#prompt-tokens .tok.pass-1").count() > 0  # a second chunk's colour
    assert page.locator("#answer-tokens .tok").count() == usage["completion_tokens"]
    assert page.locator("#key-dialog[open]").count() == 0  # the key was asked for once

    screenshot(page, tmp_path / f"console-{mode}.png")
    assert_clean(record, console_server.base_url)


def test_two_tabs_running_at_once_show_in_the_live_batch(open_console, console_server, tmp_path):
    (first, first_record), (second, second_record) = open_console(), open_console()
    # Long enough (ignore_eos) that the runs overlap for several of the live view's 1 s polls
    # even where the model decodes hundreds of tokens a second.
    start_run(first, "Count slowly from one to one hundred.", max_tokens=TWO_TAB_TOKENS)
    start_run(second, "Name every planet and one fact about each.", max_tokens=TWO_TAB_TOKENS)
    # The live view (GET /v1/meterserve/live, once a second) sees both requests running.
    first.wait_for_function(
        "() => Number(document.getElementById('live-running').dataset.value) >= 2",
        timeout=RUN_DEADLINE_MS,
    )
    screenshot(first, tmp_path / "console-two-tabs.png")
    wait_for_run(first)
    wait_for_run(second)

    # They overlapped, so they shared forward passes, and the streams say so.
    passes = []
    for record in (first_record, second_record):
        progress = [c["meterserve"] for c in record.streamed_chunks() if "meterserve" in c]
        passes.append({p["forward_pass"] for p in progress})
        assert max(p["batch_size"] for p in progress) >= 2
        assert record.streamed_chunks()[-1]["usage"]["completion_tokens"] == TWO_TAB_TOKENS
    assert passes[0] & passes[1]
    for record in (first_record, second_record):
        assert_clean(record, console_server.base_url)


def test_dark_theme_labels_and_escape(open_console, console_server, tmp_path):
    light, light_record = open_console("light")
    dark, dark_record = open_console("dark")
    background = "() => getComputedStyle(document.body).backgroundColor"
    assert light.evaluate(background) != dark.evaluate(background)
    unlabelled = dark.evaluate(
        """() => [...document.querySelectorAll('input, textarea, select')]
              .filter(e => e.type !== 'hidden' && e.labels.length === 0).map(e => e.id || e.name)"""
    )
    assert unlabelled == []
    nameless = dark.evaluate(
        "() => [...document.querySelectorAll('button')].filter(b => !b.textContent.trim()).length"
    )
    assert nameless == 0

    # Escape stops a run; the server is told (the stream is aborted), the page says so.
    start_run(dark, "Tell me a very long story about the sea.", max_tokens=400)
    dark.wait_for_selector("#answer-tokens .tok", timeout=RUN_DEADLINE_MS)
    dark.keyboard.press("Escape")
    wait_for_run(dark, "stopped")
    dark.wait_for_timeout(300)  # let the colour transitions settle for the screenshot
    screenshot(dark, tmp_path / "console-dark.png")
    for record in (light_record, dark_record):
        assert_clean(record, console_server.base_url)
