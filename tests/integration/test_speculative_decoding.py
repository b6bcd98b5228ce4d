"""Speculative decoding over HTTP on the real model, with the openai SDK, for each method: a
server started with vLLM's --speculative-config (n-gram drafts; the embedded model as its own
draft model) serves copying requests with drafts accepted, and
streaming, stop strings, n > 1 sampling and logprobs keep their contract (usage equals the
tokens delivered, a stop string ends the text, drafts never reach a client past a stop).
Its Prometheus counters show drafts verified and accepted, and generation tokens equal the
completion tokens the clients got. A draft model that cannot load is refused at start, by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
PASSAGE = (Path(__file__).resolve().parents[2] / "loadtest/data/gettysburg_address.txt").read_text()
# SmolLM2 copies this passage word for word, greedily: most drafts are accepted.
COPY = [{"role": "user", "content": "Copy the following text exactly:\n\n" + PASSAGE[:400]}]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """serverproc.NGRAM_SPEC or DRAFT_MODEL_SPEC, launched early (conftest); stopped once
    its tests ran."""
    launched: ServerProcess = request.getfixturevalue(f"{request.param}_server_launched")
    with launched.running() as server:
        yield server


@pytest.fixture
def client(spec_server: ServerProcess) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=spec_server.base_url + "/v1", api_key="none", max_retries=0)


def counters(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for name in (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_draft_model_passes",
        "spec_decode_draft_model_seconds",
        "generation_tokens",
    ):
        match = re.search(rf"^meterserve_{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert match, f"meterserve_{name}_total missing"
        found[name] = float(match.group(1))
    return found


async def test_copying_is_served_with_accepted_drafts_and_metered_exactly(
    client: AsyncOpenAI, spec_server: ServerProcess
) -> None:
    before = counters(spec_server)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=COPY,
        temperature=0,
        max_tokens=80,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens > 40
    assert "Four score and seven years ago" in text
    after = counters(spec_server)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    print(f"drafted {drafted}, accepted {accepted}, completion tokens {usage.completion_tokens}")
    assert 0 < accepted <= drafted
    assert accepted >= usage.completion_tokens / 3  # a copy: most tokens came from drafts
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    delivered = after["generation_tokens"] - before["generation_tokens"]
    assert delivered == usage.completion_tokens
    # The draft model's passes are counted and timed; n-gram drafts take none.
    passes = after["spec_decode_draft_model_passes"] - before["spec_decode_draft_model_passes"]
    seconds = after["spec_decode_draft_model_seconds"] - before["spec_decode_draft_model_seconds"]
    if spec_server.name == "draft-model":
        # A decode's first draft takes a pass, each further one another (one client here).
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        assert passes >= drafts and seconds > 0
    else:
        assert passes == 0 and seconds == 0


async def test_the_progress_stream_shows_each_passs_drafts_and_accepted_tokens(
    spec_server: ServerProcess,
) -> None:
    body = {
        "model": MODEL,
        "messages": COPY,
        "temperature": 0,
        "max_tokens": 48,
        "stream": True,
        "stream_options": {"include_usage": True, "include_progress": True},
    }
    progress, usage = [], None
    async with (
        httpx.AsyncClient(base_url=spec_server.base_url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "meterserve" in chunk:
                progress.append(chunk["meterserve"])
            usage = chunk.get("usage") or usage
    decodes = [p for p in progress if p["phase"] == "decode"]
    assert decodes and usage is not None
    for p in decodes:  # each decode pass: its token, the drafts it kept, nothing else
        assert p["num_tokens"] == 1 + p["draft_tokens"]
        assert len(p["token_ids"]) <= 1 + p["accepted_draft_tokens"] <= 1 + p["draft_tokens"]
    assert sum(p["accepted_draft_tokens"] for p in decodes) > 0
    assert sum(len(p["token_ids"]) for p in progress) == usage["completion_tokens"]


async def test_greedy_output_with_logprobs_and_a_stop_string(client: AsyncOpenAI) -> None:
    full = await client.chat.completions.create(
        model=MODEL, messages=COPY, temperature=0, max_tokens=40, logprobs=True, top_logprobs=2
    )
    choice = full.choices[0]
    assert len(choice.logprobs.content) == full.usage.completion_tokens
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    # Stop at a word well inside the copy: the text ends right before it, although drafts
    # past it were computed in the same step.
    cut = await client.chat.completions.create(
        model=MODEL, messages=COPY, temperature=0, max_tokens=40, stop=["seven"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == choice.message.content.split("seven")[0]


async def test_sampled_choices_are_reproducible_with_a_seed(client: AsyncOpenAI) -> None:
    def ask():
        return client.chat.completions.create(
            model=MODEL, messages=COPY, temperature=0.8, top_p=0.95, max_tokens=30, n=2, seed=7
        )

    first, second = await ask(), await ask()
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 60


async def test_a_json_schema_holds_with_drafts_checked_against_the_grammar(
    client: AsyncOpenAI,
) -> None:
    schema = {
        "type": "object",
        "properties": {"first_words": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["first_words", "year"],
    }
    messages = [
        {
            "role": "user",
            "content": "Give the first words of this speech and the year 1863 as JSON.\n\n"
            + PASSAGE[:300],
        }
    ]
    result = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=120,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "speech", "schema": schema, "strict": True},
        },
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content)
    assert set(value) == {"first_words", "year"} and isinstance(value["year"], int)


def test_a_draft_model_that_cannot_load_is_refused_at_start(server_logs: Path) -> None:
    config = json.dumps({"model": "/models/draft", "num_speculative_tokens": 3})
    server = ServerProcess("missing-draft-model", ["--speculative-config", config], server_logs)
    try:
        assert server.wait_exit(120) != 0
        assert "model path does not exist: /models/draft" in server.log_tail()
    finally:
        server.stop()
