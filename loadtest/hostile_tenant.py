"""Two tenants on one server, one hostile: the bars of tenant safety, measured.

    python -m loadtest.hostile_tenant --base-url http://127.0.0.1:8000 \
        --victim-key sk-alice --hostile-key sk-mallory

Start the server with an --api-keys-file of (at least) those two tenants. For each hostile
request shape, the victim streams a greedy completion while /health is probed every 100 ms;
the report gives the hostile request's time to its answer (or refusal), the victim's median and
worst inter-token gap while it ran, and /health's worst wait. Then the time to first token of
the victim's new requests sent while a hostile burst of long prompts is being computed. Then the cross-tenant prefix probe (cached
tokens the hostile tenant is told about the victim's prompt) and the unauthenticated surface.
Traffic goes only to the given base URL; every request is bounded (max_tokens, timeouts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx

from loadtest.sse import StreamTiming

VOCAB = 49_152  # SmolLM2's; the largest logit_bias the server allows
VICTIM_MAX_TOKENS = 7_000  # more than it can decode while any hostile request runs


@dataclass(slots=True)
class Outcome:
    shape: str
    status: int
    hostile_s: float
    victim_median_gap_s: float
    victim_worst_gap_s: float
    health_worst_s: float


def hostile_shapes() -> dict[str, tuple[str, dict]]:
    """name -> (path, body): the heaviest requests the limits allow, and one they refuse.
    Prompts and schemas differ from run to run, so no cache makes a run cheaper."""
    salt = int(time.time()) % 10_000
    bias = {str(i): -0.5 for i in range(VOCAB)}
    prompts = [f"Request {salt}-{i}: write a long story about the sea." for i in range(64)]
    fields = {
        f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{1,8}}-{salt}-{i}$"}
        for i in range(400)
    }
    schema = {"type": "object", "properties": fields, "required": list(fields)[:5]}
    return {
        "64 prompts, full-vocabulary logit_bias": (
            "/v1/completions",
            {"prompt": prompts, "max_tokens": 16, "logit_bias": bias, "seed": 1},
        ),
        "4 prompts x n=16, full-vocabulary logit_bias": (
            "/v1/completions",
            {"prompt": prompts[:4], "n": 16, "max_tokens": 16, "logit_bias": bias, "seed": 1},
        ),
        "64 prompts x n=16 (refused)": (
            "/v1/completions",
            {"prompt": prompts, "n": 16, "max_tokens": 16, "logit_bias": bias},
        ),
        "32 prompts of 2,000 tokens (64k tokens of prefill)": (
            "/v1/completions",
            {
                "prompt": [
                    [1000 + (7 * i + 13 * j) % 40_000 for j in range(2000)] for i in range(32)
                ],
                "max_tokens": 4,
            },
        ),
        "400-field patterned JSON schema": (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Fill in the form."}],
                "max_tokens": 32,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "form", "schema": schema},
                },
            },
        ),
    }


async def victim_stream(http: httpx.AsyncClient, stop: asyncio.Event) -> StreamTiming:
    """The victim's greedy stream, read until `stop` is set (the hostile request is done),
    so its gaps cover the whole time the hostile request ran."""
    body = {
        "messages": [{"role": "user", "content": "Tell me about the history of ships."}],
        "max_tokens": VICTIM_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    timing = StreamTiming(sent_at=time.perf_counter())
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            timing.feed(line, time.perf_counter())
            if stop.is_set():
                break  # leaving closes the stream: the server aborts it
    return timing


async def health_probe(base_url: str, stop: asyncio.Event) -> list[float]:
    waits = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        while not stop.is_set():
            start = time.perf_counter()
            await http.get("/health")
            waits.append(time.perf_counter() - start)
            await asyncio.sleep(0.1)
    return waits


async def one_shape(args, name: str, path: str, body: dict) -> Outcome:
    victim = _client(args.base_url, args.victim_key)
    hostile = _client(args.base_url, args.hostile_key)
    async with victim, hostile:
        stop = asyncio.Event()
        probe = asyncio.create_task(health_probe(args.base_url, stop))
        stream = asyncio.create_task(victim_stream(victim, stop))
        await asyncio.sleep(1.0)  # the victim is decoding when the hostile request lands
        start = time.perf_counter()
        response = await hostile.post(path, json={"model": args.model, **body})
        hostile_s = time.perf_counter() - start
        stop.set()
        timing = await stream
        waits = await probe
    gaps = timing.gaps or [0.0]
    return Outcome(
        name,
        response.status_code,
        hostile_s,
        statistics.median(gaps),
        max(gaps),
        max(waits or [0.0]),
    )


async def ttft_behind_a_burst(args) -> tuple[list[float], float]:
    """(the victim's TTFTs for three short requests sent while the hostile tenant's 32
    prompts of 2,000 tokens are computed, the hostile request's time)."""
    salt = int(time.time()) % 10_000 + 7
    prompts = [[1000 + (7 * i + 13 * j + salt) % 40_000 for j in range(2000)] for i in range(32)]
    body = {"model": args.model, "prompt": prompts, "max_tokens": 4}
    async with (
        _client(args.base_url, args.hostile_key) as hostile,
        _client(args.base_url, args.victim_key) as victim,
    ):
        start = time.perf_counter()
        burst = asyncio.create_task(hostile.post("/v1/completions", json=body))
        await asyncio.sleep(2.0)
        ttfts = []
        for k in range(3):
            timing = StreamTiming(sent_at=time.perf_counter())
            request = {"model": args.model, "prompt": f"Hello {k}", "max_tokens": 8}
            async with victim.stream(
                "POST", "/v1/completions", json={**request, "stream": True}
            ) as response:
                async for line in response.aiter_lines():
                    timing.feed(line, time.perf_counter())
            ttfts.append(timing.first_chunk_at - timing.sent_at)
        await burst
    return ttfts, time.perf_counter() - start


async def cross_tenant_cached_tokens(args) -> tuple[int, int]:
    """(what the hostile tenant is told is cached of the victim's prompt, the victim's own
    repeat): token-id prompts, so the counts are exact."""
    secret = [1000 + 7 * i for i in range(170)]

    async def cached(key: str, prompt: list[int]) -> int:
        async with _client(args.base_url, key) as http:
            body = {"model": args.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            usage = (await http.post("/v1/completions", json=body)).json()["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    await cached(args.victim_key, secret)
    return await cached(args.hostile_key, secret[:168]), await cached(args.victim_key, secret)


def public_surface(base_url: str) -> dict[str, str]:
    """Status of each route asked without a key (and whether /metrics shows tenants)."""
    result = {}
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc", "/version", "/v1/models"):
        response = httpx.get(base_url + path, timeout=30)
        note = ""
        if path == "/metrics" and response.status_code == 200:
            note = " (tenant series)" if 'tenant="' in response.text else " (no tenant series)"
        result[path] = f"{response.status_code}{note}"
    return result


def _client(base_url: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=600
    )


async def run(args) -> None:
    print(f"# hostile tenant against {args.base_url}")
    print("| hostile request | status | answered in (s) | victim median gap (s) | "
          "victim worst gap (s) | /health worst (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, (path, body) in hostile_shapes().items():
        o = await one_shape(args, name, path, body)
        print(
            f"| {o.shape} | {o.status} | {o.hostile_s:.2f} | {o.victim_median_gap_s:.3f} | "
            f"{o.victim_worst_gap_s:.3f} | {o.health_worst_s:.3f} |"
        )
    ttfts, burst_s = await ttft_behind_a_burst(args)
    print(
        "\nvictim's TTFT behind a 32 x 2,000-token burst: "
        + ", ".join(f"{t:.2f}" for t in ttfts)
        + f" s (the burst took {burst_s:.1f} s)"
    )
    hostile, own = await cross_tenant_cached_tokens(args)
    print(f"cross-tenant cached tokens: {hostile} (the victim's own repeat: {own})")
    print("unauthenticated: " + json.dumps(public_surface(args.base_url)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--victim-key", required=True)
    parser.add_argument("--hostile-key", required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
