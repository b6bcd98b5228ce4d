"""Serving benchmark: output tokens/s, TTFT and inter-token latency at several concurrencies,
against any OpenAI-compatible server, so one command measures meterserve and a peer
(llama.cpp's llama-server, vLLM, `transformers serve`) the same way.

    python -m loadtest.serving_bench --base-url http://127.0.0.1:8000 --label meterserve
    python -m loadtest.serving_bench --base-url http://127.0.0.1:8080 --label llama-server \\
        --compare meterserve.json

Every request streams a distinct prompt of exactly --prompt-tokens tokens (cut from the bundled
corpus with the default model's tokenizer) and asks for exactly --output-tokens tokens
(`ignore_eos`, plus llama.cpp's `n_predict`); completions that come back shorter are counted.
Decoding is greedy unless --temperature > 0 (with --top-p); with --seed S, request i of a level
sends seed S + i, so a sampled run is reproducible on servers that honour `seed`.
At concurrency c, c workers send --num-requests requests back to back (closed loop);
throughput = output tokens / wall time of the level. The last line printed is one JSON object
with the figures per concurrency. No locust here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loadtest.http_stream import timed_stream
from loadtest.sse import StreamTiming
from loadtest.stats import Distribution
from loadtest.text import TextSource, load_tokenizer


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    num_requests: int | None = None  # per level; None = max(8, 2 × concurrency)
    prompt_tokens: int = 128
    output_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0  # sent only when < 1
    seed: int | None = None  # request i of a level sends seed + i; None sends no seed
    api_key: str = ""
    timeout_s: float = 600.0
    # Structured output for every request: {"type": "json_object"} or a json_schema format.
    response_format: dict | None = None

    def requests_at(self, concurrency: int) -> int:
        return self.num_requests or max(8, 2 * concurrency)

    def decoding(self) -> str:
        if self.temperature == 0.0:
            return "greedy"
        seed = "unseeded" if self.seed is None else f"seed {self.seed}+i"
        return f"sampled (temperature {self.temperature:g}, top_p {self.top_p:g}, {seed})"


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    short_completions: int  # succeeded with fewer than output_tokens tokens
    mean_prompt_tokens: float | None  # as the server counted them (usage.prompt_tokens)
    ttft_s: dict = field(default_factory=dict)
    itl_s: dict = field(default_factory=dict)
    tpot_s: dict = field(default_factory=dict)
    e2e_s: dict = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)


def build_body(cfg: BenchConfig, prompt: str, index: int = 0) -> dict:
    """The request body of request `index` of a level (its seed is cfg.seed + index)."""
    body: dict = {
        "model": cfg.model,
        "max_tokens": cfg.output_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # meterserve, vLLM, llama.cpp: generate exactly max_tokens
        "n_predict": cfg.output_tokens,  # llama.cpp's name for max_tokens; others ignore it
    }
    if cfg.top_p < 1.0:
        body["top_p"] = cfg.top_p
    if cfg.seed is not None:
        body["seed"] = cfg.seed + index
    if cfg.response_format is not None:  # a finished object ends it: ignore_eos is refused
        body["response_format"] = cfg.response_format
        del body["ignore_eos"]
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one_request(
    client: httpx.AsyncClient, cfg: BenchConfig, prompt: str, index: int = 0
) -> StreamTiming:
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    return await timed_stream(client, path, build_body(cfg, prompt, index))


async def run_level(
    client: httpx.AsyncClient, cfg: BenchConfig, prompts: list[str], concurrency: int
) -> LevelResult:
    """`concurrency` workers drain a queue of requests, so exactly that many are in flight
    until the queue runs dry."""
    total = cfg.requests_at(concurrency)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    timings: list[StreamTiming] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            timings.append(await one_request(client, cfg, prompts[i % len(prompts)], i))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, total))))
    return level_result(cfg, concurrency, timings, time.perf_counter() - start)


def level_result(
    cfg: BenchConfig, concurrency: int, timings: list[StreamTiming], wall_s: float
) -> LevelResult:
    ok = [t for t in timings if t.failure() is None]
    errors: dict[str, int] = {}
    for t in timings:
        if (reason := t.failure()) is not None:
            errors[reason[:120]] = errors.get(reason[:120], 0) + 1
    tokens = sum(t.completion_tokens or 0 for t in ok)
    prompt_counts = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
    return LevelResult(
        concurrency=concurrency,
        requests=len(timings),
        failed=len(timings) - len(ok),
        wall_s=wall_s,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        short_completions=sum(1 for t in ok if (t.completion_tokens or 0) < cfg.output_tokens),
        mean_prompt_tokens=sum(prompt_counts) / len(prompt_counts) if prompt_counts else None,
        ttft_s=Distribution.of([t.ttft for t in ok if t.ttft is not None]).to_dict(),
        itl_s=Distribution.of([g for t in ok for g in t.gaps]).to_dict(),
        tpot_s=Distribution.of([t.tpot for t in ok if t.tpot is not None]).to_dict(),
        e2e_s=Distribution.of([t.e2e for t in ok if t.e2e is not None]).to_dict(),
        errors=errors,
    )


def make_prompts(source: TextSource, count: int, num_tokens: int) -> list[str]:
    """Distinct prompts (different corpus offsets), so no request hits another's prefix cache."""
    stride = max(1, source.num_positions // max(1, count))
    return [source.text(i * stride + i * 7, num_tokens) for i in range(count)]


async def run_bench(cfg: BenchConfig, prompts: list[str], log=print) -> list[LevelResult]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        warm = await one_request(client, cfg, prompts[-1], len(prompts))  # not counted
        if warm.failure() is not None:
            raise RuntimeError(f"warm-up request failed: {warm.failure()}")
        results = []
        for concurrency in cfg.concurrency:
            result = await run_level(client, cfg, prompts, concurrency)
            log(
                f"  concurrency {concurrency:>3}: {result.output_tokens_per_s:8.1f} output tok/s "
                f"({result.requests} requests, {result.failed} failed, {result.wall_s:.1f} s)"
            )
            results.append(result)
        return results


# ---- output ---------------------------------------------------------------------------------


def format_table(results: list[LevelResult], baseline: dict | None = None) -> str:
    base = {lvl["concurrency"]: lvl for lvl in (baseline or {}).get("levels", [])}
    head = (f"{'conc':>5}{'reqs':>6}{'fail':>6}{'short':>6}{'out tok/s':>11}"
            f"{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'ITL p50':>9}{'p90':>7}{'p99':>7}"
            f"{'TPOT p50':>9}")  # fmt: skip
    head += "  vs baseline" if baseline else ""
    lines = [head + "   (latencies in ms)"]
    for r in results:
        ttft = "".join(f"{_ms(r.ttft_s[q]):>{w}}" for q, w in (("p50", 10), ("p90", 8), ("p99", 8)))
        itl = "".join(f"{_ms(r.itl_s[q]):>{w}}" for q, w in (("p50", 9), ("p90", 7), ("p99", 7)))
        row = (
            f"{r.concurrency:>5}{r.requests:>6}{r.failed:>6}{r.short_completions:>6}"
            f"{r.output_tokens_per_s:>11.1f}{ttft}{itl}{_ms(r.tpot_s['p50']):>9}"
        )
        peer = base.get(r.concurrency)
        if peer and peer.get("output_tokens_per_s"):
            row += f"  {r.output_tokens_per_s / peer['output_tokens_per_s']:.2f}× tok/s"
        lines.append(row)
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def result_json(cfg: BenchConfig, label: str, results: list[LevelResult]) -> str:
    return json.dumps(
        {
            "label": label,
            "base_url": cfg.base_url,
            "model": cfg.model,
            "endpoint": cfg.endpoint,
            "prompt_tokens": cfg.prompt_tokens,
            "output_tokens": cfg.output_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "response_format": cfg.response_format,
            "levels": [asdict(r) for r in results],
        },
        separators=(",", ":"),
    )


# ---- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.serving_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="default: the first of GET /v1/models")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level; default max(8, 2 × concurrency)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; sent only when < 1")
    p.add_argument(
        "--seed", type=int, default=None, help="request i of a level sends seed+i (default none)"
    )
    p.add_argument(
        "--response-format",
        default=None,
        help="constrain every request: json_object, or a JSON schema file (a schema whose "
        "output outlasts --output-tokens keeps every row constrained for the whole run)",
    )
    p.add_argument(
        "--tokenizer",
        default="default",
        help="default (the embedded GGUF's) | path to .gguf or HF dir | approx",
    )
    p.add_argument("--api-key", default="")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default="", help="name of the server in the output")
    p.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="a previous run's JSON line (e.g. a peer's) to print ratios against",
    )
    return p


def response_format(option: str | None) -> dict | None:
    """--response-format: None, json_object, or the path of a JSON schema."""
    if option is None:
        return None
    if option == "json_object":
        return {"type": "json_object"}
    schema = json.loads(Path(option).read_text())
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    if not levels or min(levels) < 1:
        print("serving_bench: --concurrency needs positive integers", file=sys.stderr)
        return 2
    if not (args.temperature >= 0.0 and 0.0 < args.top_p <= 1.0):
        print("serving_bench: needs --temperature >= 0 and 0 < --top-p <= 1", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or _first_model(args.base_url, headers)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"serving_bench: cannot list models at {args.base_url}: {exc}", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        base_url=args.base_url.rstrip("/"), model=model, endpoint=args.endpoint,
        concurrency=levels, num_requests=args.num_requests, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed, api_key=args.api_key, timeout_s=args.timeout,
        response_format=response_format(args.response_format),
    )  # fmt: skip
    source = TextSource(load_tokenizer(args.tokenizer))
    prompts = make_prompts(source, max(cfg.requests_at(c) for c in levels), cfg.prompt_tokens)
    label = args.label or cfg.base_url
    exact = "exact" if source.exact else "approximate"
    lengths = f"{cfg.prompt_tokens}-token prompts ({exact}), {cfg.output_tokens} output tokens"
    print(f"serving benchmark: {label}  model={model}  /v1/{cfg.endpoint}  {lengths}")
    print(f"decoding: {cfg.decoding()}")
    try:
        results = asyncio.run(run_bench(cfg, prompts))
    except RuntimeError as exc:
        print(f"serving_bench: {exc}", file=sys.stderr)
        return 1
    baseline = (
        json.loads(args.compare.read_text().strip().splitlines()[-1]) if args.compare else None
    )
    print(format_table(results, baseline))
    print(result_json(cfg, label, results))
    return 0 if all(r.failed == 0 for r in results) else 1


def _first_model(base_url: str, headers: dict[str, str]) -> str:
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
