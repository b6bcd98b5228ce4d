"""Prompt logprobs over HTTP on the real model: `echo` with `logprobs` (what lm-eval-harness's
local-completions sends for loglikelihood tasks) and vLLM's `prompt_logprobs` extension."""

from __future__ import annotations

import json
import math

import httpx
from serverproc import assert_no_leaked_blocks, wait_idle

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris"
# What lm-eval's local-completions sends for a loglikelihood request (besides the prompt).
LM_EVAL_BODY = {"model": MODEL, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}


async def tokenize(http: httpx.AsyncClient, text: str) -> list[int]:
    response = await http.post("/tokenize", json={"prompt": text})
    response.raise_for_status()
    return response.json()["tokens"]


async def complete(http: httpx.AsyncClient, **body) -> dict:
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_echo_with_logprobs_covers_prompt_then_completion(http: httpx.AsyncClient):
    ids = await tokenize(http, PROMPT)
    body = await complete(http, prompt=PROMPT, echo=True, **LM_EVAL_BODY)
    [choice] = body["choices"]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith(PROMPT) and "prompt_logprobs" not in choice
    n = len(ids) + 1  # the prompt's tokens, then the one completion token
    assert [len(logprobs[k]) for k in logprobs] == [n] * 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    # Offsets index the echoed text: each prompt token's text sits where its offset says.
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[len(ids)] == len(PROMPT)
    for token, offset in zip(logprobs["tokens"], offsets, strict=True):
        assert text[offset : offset + len(token)] == token
    # A token's logprob equals its top-1 exactly when it is the greedy choice (lm-eval's
    # is_greedy test); both come from one log-softmax.
    for lp, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True):
        assert lp <= max(top.values()) + 1e-6
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 1


async def test_lm_eval_style_batched_token_prompts(http: httpx.AsyncClient):
    """Token-id prompts in one request, as lm-eval sends them (tokenized_requests)."""
    prompts = [await tokenize(http, PROMPT), await tokenize(http, "One, two, three")]
    body = await complete(http, prompt=prompts, echo=True, **LM_EVAL_BODY)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    for choice, ids in zip(choices, prompts, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(ids) + 1 and token_logprobs[0] is None
    # The same prompt alone gives the same prompt logprobs (batching changes no value).
    alone = await complete(http, prompt=prompts[0], echo=True, **LM_EVAL_BODY)
    got = choices[0]["logprobs"]["token_logprobs"][1:-1]
    want = alone["choices"][0]["logprobs"]["token_logprobs"][1:-1]
    assert all(math.isclose(a, b, abs_tol=0.05) for a, b in zip(got, want, strict=True))


async def test_vllm_prompt_logprobs_extension(http: httpx.AsyncClient):
    ids = await tokenize(http, PROMPT)
    await complete(http, prompt=PROMPT, max_tokens=1)  # warm the prefix cache
    body = await complete(
        http, prompt=PROMPT, max_tokens=1, temperature=0, prompt_logprobs=2, echo=True, logprobs=0
    )
    [choice] = body["choices"]
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    echo = choice["logprobs"]
    assert echo["top_logprobs"][1] == {}  # logprobs=0: no alternatives in the echo part
    for position, (token_id, entry) in enumerate(zip(ids, prompt_logprobs, strict=True)):
        if position == 0:
            continue
        assert 2 <= len(entry) <= 3  # the prompt token, and the top 2 (it may be among them)
        mine = entry[str(token_id)]
        assert mine["logprob"] == echo["token_logprobs"][position]
        assert mine["decoded_token"] == echo["tokens"][position]
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and mine["rank"] >= 1
    # Its whole prompt was computed: no prefix-cache hit although the prompt was cached.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_streamed_echo_carries_prompt_logprobs(http: httpx.AsyncClient):
    ids = await tokenize(http, PROMPT)
    body = {"prompt": PROMPT, "echo": True, "stream": True, **LM_EVAL_BODY, "max_tokens": 3}
    chunks = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert choices[0]["text"] == PROMPT
    token_logprobs = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    assert len(token_logprobs) == len(ids) + 3 and token_logprobs[0] is None
    unary = await complete(http, prompt=PROMPT, echo=True, **LM_EVAL_BODY)
    assert "".join(c["text"] for c in choices).startswith(unary["choices"][0]["text"])


async def test_prompt_logprobs_refused_when_streaming(http: httpx.AsyncClient):
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "prompt_logprobs": 1}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"
    response = await http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 21}
    )
    assert response.status_code == 400


async def test_no_leaked_blocks_after_prompt_logprobs(http: httpx.AsyncClient):
    assert_no_leaked_blocks(await wait_idle(http))
