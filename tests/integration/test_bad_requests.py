"""A table of bad requests: each gets its status and an OpenAI error body; the server survives.

Rows are (id, path, body, headers override, expected status, expected param or None). A body
given as bytes is sent raw; anything else is sent as JSON.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serverproc import API_KEY, assert_no_leaked_blocks, wait_idle

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4} | fields


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 4} | fields


NO_AUTH = {"Authorization": ""}
BAD_CASES = [
    ("malformed-json", COMPLETIONS, b'{"prompt": "hi", ', None, 400, None),
    ("json-array-body", COMPLETIONS, b"[1, 2, 3]", None, 400, None),
    ("empty-body", CHAT, b"", None, 400, None),
    ("invalid-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe bad"}', None, 400, None),
    ("max-tokens-wrong-type", COMPLETIONS, completion(max_tokens="ten"), None, 400, "max_tokens"),
    ("max-tokens-negative", COMPLETIONS, completion(max_tokens=-5), None, 400, "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), None, 400, "max_tokens"),
    ("max-tokens-huge", COMPLETIONS, completion(max_tokens=10**9), None, 400, "max_tokens"),
    ("temperature-too-high", COMPLETIONS, completion(temperature=3.5), None, 400, "temperature"),
    ("temperature-negative", CHAT, chat(temperature=-1), None, 400, "temperature"),
    ("temperature-string", CHAT, chat(temperature="hot"), None, 400, "temperature"),
    ("top-p-zero", COMPLETIONS, completion(top_p=0), None, 400, "top_p"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), None, 400, "top_p"),
    ("presence-penalty-range", CHAT, chat(presence_penalty=5), None, 400, "presence_penalty"),
    ("empty-messages", CHAT, chat(messages=[]), None, 400, "messages"),
    (
        "unknown-role",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        None,
        400,
        "messages",
    ),
    ("messages-not-a-list", CHAT, chat(messages="hello"), None, 400, "messages"),
    ("missing-messages", CHAT, {"model": MODEL}, None, 400, "messages"),
    ("missing-prompt", COMPLETIONS, {"model": MODEL}, None, 400, "prompt"),
    ("empty-prompt", COMPLETIONS, completion(prompt=""), None, 400, "prompt"),
    ("prompt-too-long", COMPLETIONS, completion(prompt=[42] * 9000), None, 400, "prompt"),
    ("prompt-token-out-of-vocab", COMPLETIONS, completion(prompt=[1, 10**7]), None, 400, "prompt"),
    ("unknown-model", CHAT, chat(model="gpt-17"), None, 404, "model"),
    ("n-too-large", COMPLETIONS, completion(n=1000), None, 400, "n"),
    ("n-zero", CHAT, chat(n=0), None, 400, "n"),
    ("logit-bias-bad-key", CHAT, chat(logit_bias={"abc": 1}), None, 400, "logit_bias"),
    (
        "logit-bias-key-out-of-vocab",
        CHAT,
        chat(logit_bias={"99999999": 1}),
        None,
        400,
        "logit_bias",
    ),
    (
        "logit-bias-value-range",
        COMPLETIONS,
        completion(logit_bias={"42": 500}),
        None,
        400,
        "logit_bias",
    ),
    (
        "top-logprobs-too-many",
        CHAT,
        chat(logprobs=True, top_logprobs=50),
        None,
        400,
        "top_logprobs",
    ),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs"),
    ("completion-logprobs-too-many", COMPLETIONS, completion(logprobs=30), None, 400, "logprobs"),
    ("stop-wrong-type", COMPLETIONS, completion(stop=7), None, 400, "stop"),
    ("stop-empty-string", COMPLETIONS, completion(stop=[""]), None, 400, "stop"),
    ("stream-wrong-type", CHAT, chat(stream="yes"), None, 400, "stream"),
    (
        "min-tokens-above-max",
        COMPLETIONS,
        completion(min_tokens=9, max_tokens=2),
        None,
        400,
        "min_tokens",
    ),
    ("stop-token-id-out-of-vocab", CHAT, chat(stop_token_ids=[10**8]), None, 400, "stop_token_ids"),
    (
        "image-content-part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        None,
        400,
        "messages",
    ),
    (
        "json-too-deep",
        COMPLETIONS,
        b'{"prompt": "x", "a": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        None,
        400,
        None,
    ),
    ("json-nan-literal", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', None, 400, None),
    ("json-infinity-literal", CHAT, b'{"messages": [], "top_p": -Infinity}', None, 400, None),
    ("float-beyond-range", COMPLETIONS, b'{"prompt": "x", "temperature": 1e400}', None, 400, None),
    ("seed-beyond-64-bits", COMPLETIONS, completion(seed=2**70), None, 400, "seed"),
    ("seed-beyond-int64", CHAT, chat(seed=2**63), None, 400, "seed"),
    ("token-id-beyond-64-bits", COMPLETIONS, completion(prompt=[1, 2**80]), None, 400, "prompt"),
    ("max-tokens-beyond-64-bits", CHAT, chat(max_tokens=-(2**70)), None, 400, "max_tokens"),
    ("functions-refused", CHAT, chat(functions=[{"name": "f"}]), None, 400, "functions"),
    ("tool-type-custom", CHAT, chat(tools=[{"type": "custom", "custom": {}}]), None, 400, "tools"),
    (
        "tool-choice-names-no-tool",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        None,
        400,
        "tool_choice",
    ),
    (
        "response-format-schema-does-not-compile",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 3}},
            }
        ),
        None,
        400,
        "response_format",
    ),
    (
        "tool-call-without-function",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function"}],
                },
            ]
        ),
        None,
        400,
        "messages",
    ),
    ("suffix-refused", COMPLETIONS, completion(suffix="!"), None, 400, "suffix"),
    ("priority-under-fcfs", CHAT, chat(priority=-5), None, 400, "priority"),
    ("best-of-refused", COMPLETIONS, completion(best_of=3), None, 400, "best_of"),
    ("missing-auth", CHAT, chat(), NO_AUTH, 401, None),
    ("wrong-api-key", COMPLETIONS, completion(), {"Authorization": "Bearer nope"}, 401, None),
    ("oversized-body", COMPLETIONS, completion(prompt="x" * (5 * 2**20)), None, 413, None),
    ("detokenize-bad-ids", "/detokenize", {"tokens": [-1]}, None, 400, "tokens"),
    ("tokenize-nothing", "/tokenize", {}, None, 400, "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_CASES],
)
async def test_bad_request(http: httpx.AsyncClient, path, body, headers, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    request_headers = {"Content-Type": "application/json"} | (headers or {})
    if request_headers.get("Authorization") == "":
        del request_headers["Authorization"]
        http.headers.pop("Authorization", None)
    response = await http.post(path, content=content, headers=request_headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error


async def test_ignored_and_unknown_fields_are_accepted(http: httpx.AsyncClient):
    fields = {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
              "response_format": {"type": "text"}, "tool_choice": "none",
              "not_an_openai_field": 1}  # fmt: skip
    response = await http.post(CHAT, json=chat(**fields))
    assert response.status_code == 200, response.text


async def test_context_error_names_both_numbers(http: httpx.AsyncClient):
    # The limit named is what one request can use: the context, or less where the KV budget
    # holds fewer tokens (float32 KV on a CPU without bf16); /v1/models reports the same.
    limit = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
    response = await http.post(COMPLETIONS, json=completion(max_tokens=10**9))
    message = response.json()["error"]["message"]
    assert "1000000000" in message and f"{limit} tokens" in message
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_unknown_route_and_method(http: httpx.AsyncClient):
    missing = await http.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    wrong_method = await http.get(COMPLETIONS)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]


async def test_open_endpoints_need_no_key(main_server):
    async with httpx.AsyncClient(base_url=main_server.base_url, timeout=30) as anonymous:
        assert (await anonymous.get("/health")).status_code == 200
        assert (await anonymous.get("/metrics")).status_code == 200
        assert (await anonymous.get("/v1/models")).status_code == 401


async def test_server_still_serves_after_bad_requests(http: httpx.AsyncClient):
    response = await http.post(COMPLETIONS, json=completion(max_tokens=3, ignore_eos=True))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
    info = await wait_idle(http)
    assert_no_leaked_blocks(info)
    rejected = await http.get("/metrics")
    assert 'reason="invalid_request"' in rejected.text
    assert API_KEY not in rejected.text
