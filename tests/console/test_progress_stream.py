"""The streaming API's progress extension and the live endpoint over real HTTP, as any client
(not only the console) uses them: stream_options.include_progress on both endpoints, with
n > 1; nothing changes for a request that does not ask; GET /v1/meterserve/live."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT_PROMPT = (
    "Please list, one per line, the colours of the rainbow and a fruit of each colour, then say "
    "which of them you like best and why you like it more than the others."
)
PROGRESS = {"include_usage": True, "include_progress": True}


def stream(api: httpx.Client, path: str, body: dict) -> list[dict]:
    chunks = []
    with api.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def progress_of(chunks: list[dict], index: int = 0) -> list[dict]:
    return [
        c["meterserve"] for c in chunks if "meterserve" in c and c["meterserve"]["index"] == index
    ]


def test_chat_progress_covers_the_prompt_chunk_by_chunk_then_one_token_per_pass(api):
    body = {
        "messages": [{"role": "user", "content": CHAT_PROMPT}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": PROGRESS,
    }
    chunks = stream(api, "/v1/chat/completions", body)
    usage = chunks[-1]["usage"]
    progress = progress_of(chunks)
    prefill = [p for p in progress if p["phase"] == "prefill"]
    decode = [p for p in progress if p["phase"] == "decode"]

    # Prefill chunks tile the prompt (after any prefix-cache hit) in increasing passes.
    start = prefill[0]["start_position"]
    assert start == usage["prompt_tokens_details"]["cached_tokens"]  # hits count as computed
    for p in prefill:
        assert p["start_position"] == start and 1 <= p["num_tokens"] <= 32
        start += p["num_tokens"]
        assert p["prompt_tokens_computed"] == start
    assert start == usage["prompt_tokens"] == prefill[0]["prompt_tokens"]
    assert len(prefill) >= 2  # the step budget is 32 tokens
    assert [p["token_ids"] for p in prefill[:-1]] == [[]] * (len(prefill) - 1)
    assert len(prefill[-1]["token_ids"]) == 1  # the first token comes out of the prefill
    assert [len(p["token_ids"]) for p in decode] == [1] * (usage["completion_tokens"] - 1)
    passes = [p["forward_pass"] for p in progress]
    assert passes == sorted(set(passes))

    # Running totals grow to the settled bill; TTFT is the first token's elapsed time.
    for key in ("prefill_cost_usd", "decode_cost_usd", "prefill_flops", "decode_flops"):
        values = [p[key] for p in progress]
        assert values == sorted(values)
        assert values[-1] == usage[key]
    assert usage["prefill_cost_usd"] + usage["decode_cost_usd"] == pytest.approx(usage["cost_usd"])
    assert usage["prefill_flops"] + usage["decode_flops"] == pytest.approx(usage["flops"])
    assert prefill[-1]["elapsed_seconds"] == pytest.approx(usage["time_to_first_token_seconds"])
    # Progress-only chunks are OpenAI chunks with no choices; token chunks keep theirs.
    for chunk in chunks:
        if "meterserve" in chunk and not chunk["meterserve"]["token_ids"]:
            assert chunk["choices"] == []
        elif "meterserve" in chunk:
            assert len(chunk["choices"]) == 1


def test_completions_progress_with_two_choices_names_each_choice(api):
    body = {
        "prompt": "The three primary colours are",
        "max_tokens": 4,
        "n": 2,
        "temperature": 0.8,
        "seed": 3,
        "ignore_eos": True,
        "stream_options": PROGRESS,
    }
    chunks = stream(api, "/v1/completions", body)
    usage = chunks[-1]["usage"]
    produced = 0
    for index in (0, 1):
        progress = progress_of(chunks, index)
        assert progress and progress[-1]["prompt_tokens_computed"] == progress[0]["prompt_tokens"]
        produced += sum(len(p["token_ids"]) for p in progress)
        for chunk in chunks:
            if chunk.get("meterserve", {}).get("index") == index and chunk["choices"]:
                assert chunk["choices"][0]["index"] == index
    assert produced == usage["completion_tokens"] == 8


def test_a_request_that_does_not_ask_gets_no_progress(api):
    body = {"prompt": CHAT_PROMPT, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    plain = stream(api, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert not any("meterserve" in chunk for chunk in plain)
    assert len(plain) == 3 + 1  # one chunk per token, then usage
    # Progress is a streaming feature: a non-streamed request ignores the option.
    whole = api.post("/v1/completions", json=body | {"stream_options": PROGRESS}).json()
    assert "meterserve" not in whole and whole["usage"]["completion_tokens"] == 3


def test_the_live_endpoint_needs_the_key_and_reports_the_model_and_the_minute(api, console_server):
    anonymous = httpx.get(console_server.base_url + "/v1/meterserve/live", timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    live = api.get("/v1/meterserve/live").json()
    metrics = api.get("/metrics").text
    [parameters] = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("meterserve_model_parameters{")
    ]
    assert live["model_parameters"] == parameters > 0
    assert set(live["now"]) == {
        "num_running", "num_waiting", "kv_cache_usage", "max_num_seqs", "kv_cache_capacity_tokens"
    }  # fmt: skip
    assert 1 <= live["window_seconds"] <= 60
    minute = live["last_minute"]
    for key in ("mfu", "mbu", "busy_ratio", "generation_tokens_per_second"):
        assert minute[key] is None or minute[key] >= 0
    series = live["series"]
    assert len(series["num_running"]) == len(series["mfu"]) == 60


def test_the_console_is_public_and_same_origin_only(console_server):
    page = httpx.get(console_server.base_url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    for name in ("console.js", "console.css", "favicon.svg"):
        assert httpx.get(f"{console_server.base_url}/console/{name}", timeout=30).status_code == 200
    missing = httpx.get(console_server.base_url + "/console/secrets.txt", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    config = httpx.get(console_server.base_url + "/console/config.json", timeout=30).json()
    assert config == {"requires_api_key": True}


def test_tokenize_can_return_each_tokens_text(api):
    result = api.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = result.json()
    assert "".join(body["token_strs"]) == "Hello world"
    assert len(body["token_strs"]) == body["count"] == len(body["tokens"])
