"""Two tenants on one real server, one of them hostile: neither reads the other's prompts
through the prefix cache, and no request shape the limits allow stalls the other.

The server runs the embedded model with an API-keys file of two tenants; clients are the
official `openai` SDK and httpx over real HTTP. Prompts are token ids, so cached-token counts
are exact: a hit covers whole 16-token blocks and never the last prompt token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import AsyncOpenAI, BadRequestError
from server_process import ServerProcess
from serverproc import wait_idle

MODEL = "SmolLM2-135M-Instruct"
ALICE, MALLORY = "sk-alice", "sk-mallory"
BLOCK = 16
VOCAB = 49_152  # SmolLM2's
SECRET = [1000 + 7 * i for i in range(170)]  # alice's confidential prompt, as token ids
CACHED_WHOLE = (len(SECRET) - 1) // BLOCK * BLOCK  # 160: what a full hit of SECRET covers


@pytest.fixture(scope="module")
def tenant_server(server_logs: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    keys.write_text(
        yaml.safe_dump({"tenants": {"alice": {"keys": [ALICE]}, "mallory": {"keys": [MALLORY]}}})
    )
    # A KV budget smaller than the model's 8,192-token context: /v1/models must say so.
    args = ["--api-keys-file", str(keys), "--kv-cache-bytes", "64MiB"]
    server = ServerProcess("tenants", args, server_logs)
    with server.running():
        yield server


@pytest.fixture
def clients(tenant_server: ServerProcess) -> Iterator[tuple[AsyncOpenAI, AsyncOpenAI]]:
    url = tenant_server.base_url + "/v1"
    yield (
        AsyncOpenAI(base_url=url, api_key=ALICE, max_retries=0),
        AsyncOpenAI(base_url=url, api_key=MALLORY, max_retries=0),
    )


async def _cached(client: AsyncOpenAI, prompt: list[int], **extra) -> int:
    completion = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra or None
    )
    details = completion.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


async def test_a_tenant_hits_only_its_own_prefix_cache(clients) -> None:
    alice, mallory = clients
    assert await _cached(alice, SECRET) == 0  # first sight: nothing cached
    # Mallory probes with the first 168 tokens of alice's prompt: alice's blocks, none hit.
    assert await _cached(mallory, SECRET[:168]) == 0
    # Alice's own repeat hits every whole block her first request cached.
    assert await _cached(alice, SECRET) == CACHED_WHOLE
    # Mallory's second send hits the blocks her own first send cached: her own cache works.
    assert await _cached(mallory, SECRET[:168]) == (168 - 1) // BLOCK * BLOCK
    # vLLM's cache_salt narrows sharing within a tenant: a new salt starts cold, then hits.
    assert await _cached(alice, SECRET, cache_salt="project-x") == 0
    assert await _cached(alice, SECRET, cache_salt="project-x") == CACHED_WHOLE


async def test_choices_of_one_request_still_share_their_prompt(clients) -> None:
    """n choices of one request are one tenant's: the engine computes the prompt blocks
    once (the later choices are admitted with the first's blocks as hits)."""
    alice, _ = clients
    prompt = [2000 + 3 * i for i in range(65)]
    completion = await alice.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, n=4, temperature=1.0, seed=5
    )
    assert len(completion.choices) == 4 and completion.usage.prompt_tokens == 65


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": [[1, 2, 3]] * 64, "n": 2}, "n"),
        ({"prompt": ["hi"] * 65}, "prompt"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "stop": ["x" * 1025]}, "stop"),
        ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "hi", "stop_token_ids": [5] * 1025}, "stop_token_ids"),
        ({"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ({"prompt": "hi", "cache_salt": "s" * 257}, "cache_salt"),
    ],
)
def test_every_size_limit_is_a_400_naming_its_field(tenant_server, fields, param) -> None:
    response = httpx.post(
        tenant_server.base_url + "/v1/completions",
        json={"model": MODEL, "max_tokens": 1, **fields},
        headers={"Authorization": f"Bearer {MALLORY}"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_the_largest_allowed_request_runs_beside_another_tenant(
    clients, tenant_server
) -> None:
    """Mallory's heaviest allowed shape (64 prompts, a bias on every token of the
    vocabulary) is answered while alice streams and /health keeps answering; the figures
    are printed, not asserted (bars are benchmarks: loadtest/hostile_tenant.py)."""
    alice, mallory = clients
    bias = {str(i): -0.5 for i in range(VOCAB)}
    prompts = [f"Hostile prompt number {i}: tell me a story." for i in range(64)]

    async def hostile() -> int:
        completion = await mallory.completions.create(
            model=MODEL, prompt=prompts, max_tokens=4, logit_bias=bias, temperature=1.0, seed=1
        )
        return len(completion.choices)

    async def streaming() -> list[float]:
        stamps = []
        stream = await alice.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count from one to fifty in words."}],
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.monotonic())
        return stamps

    async def health(stop: asyncio.Event) -> list[float]:
        waits = []
        async with httpx.AsyncClient(base_url=tenant_server.base_url, timeout=30) as http:
            while not stop.is_set():
                start = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                waits.append(time.monotonic() - start)
                await asyncio.sleep(0.1)
        return waits

    stop = asyncio.Event()
    probe = asyncio.create_task(health(stop))
    stream_task = asyncio.create_task(streaming())
    await asyncio.sleep(0.3)  # alice's stream is under way when the hostile request lands
    start = time.monotonic()
    assert await hostile() == 64
    hostile_s = time.monotonic() - start
    stamps = await stream_task
    stop.set()
    waits = await probe
    assert len(stamps) >= 40  # alice got her answer (48 tokens; a few may share a chunk)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    print(
        f"hostile request {hostile_s:.2f} s; alice's worst gap {max(gaps):.3f} s; "
        f"/health worst {max(waits):.3f} s over {len(waits)} probes"
    )
    headers = {"Authorization": f"Bearer {ALICE}"}
    async with httpx.AsyncClient(base_url=tenant_server.base_url, headers=headers) as http:
        info = await wait_idle(http)
    assert info["invariants_ok"], info["invariants_error"]


async def test_bad_requests_from_one_tenant_leave_the_other_untouched(clients) -> None:
    alice, mallory = clients
    with pytest.raises(BadRequestError):
        await mallory.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, logit_bias={"-3": 1}
        )
    completion = await alice.completions.create(
        model=MODEL, prompt=json.dumps({"still": "served"}), max_tokens=2, temperature=0
    )
    assert completion.choices[0].finish_reason == "length"


def test_models_reports_the_context_a_request_can_really_get(tenant_server) -> None:
    headers = {"Authorization": f"Bearer {ALICE}"}
    models = httpx.get(tenant_server.base_url + "/v1/models", headers=headers, timeout=30)
    limit = models.json()["data"][0]["max_model_len"]
    assert 0 < limit < 8192  # the KV budget, not the model's context
    prompt = [1000 + i for i in range(10)]
    response = httpx.post(
        tenant_server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": limit - 9},
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"is {limit} tokens" in error["message"]
