"""Speculative-decoding benchmark on input-grounded prompts: output tokens/s, TTFT and tokens per
request when the answer repeats the prompt (copy, quote, lightly edit a given passage or code),
against any OpenAI-compatible server, so one command measures a server with and without n-gram
drafts, and a peer, the same way.

    python -m loadtest.spec_bench --base-url http://127.0.0.1:8020 --label meterserve
    python -m loadtest.spec_bench --base-url http://127.0.0.1:8010 --label vllm-ngram \\
        --compare vllm.json meterserve.json

The workload is the bundled loadtest/data/grounded/prompts.json (12 chat requests). At each
level of --clients, every client sends its share of --requests requests back to back (closed
loop) to /v1/chat/completions, streaming, greedy unless --temperature > 0, at most --max-tokens
tokens each and stopping where the model stops (no ignore_eos: how long a copy is belongs to
the figure). At 1 client the prompts go in order; at c clients, client k cycles through them
from offset k × ceil(requests / c), so the clients start on different prompts.

Output tokens are the final usage chunk's completion_tokens; tok/s = output tokens / wall time
of the level. When GET /metrics answers in Prometheus' format, every counter whose name holds
"spec_decode" and ends in "_total" (meterserve_spec_decode_*, vLLM's vllm:spec_decode_*) is read
before and after each level and the difference printed, with accepted / draft tokens where both
exist. --compare prints this run's tok/s over each other run's, level by level; the last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loadtest.http_stream import timed_stream
from loadtest.prom import parse_metrics
from loadtest.sse import StreamTiming
from loadtest.stats import Distribution

WORKLOAD = Path(__file__).parent / "data" / "grounded" / "prompts.json"
WARM_UP = [{"role": "user", "content": "Say hello."}]  # not a workload prompt: no cache hit


@dataclass(frozen=True, slots=True)
class GroundedPrompt:
    id: str
    messages: list[dict]


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    base_url: str
    model: str
    clients: tuple[int, ...] = (1, 8)
    num_requests: int | None = None  # per level; None = max(6, 2 × clients)
    max_tokens: int = 160
    temperature: float = 0.0
    top_p: float = 1.0  # sent only when < 1
    api_key: str = ""
    timeout_s: float = 600.0

    def requests_at(self, clients: int) -> int:
        return self.num_requests or max(6, 2 * clients)


@dataclass(slots=True)
class RequestRecord:
    """One request of a level, as the server's usage counted it."""

    id: str
    completion_tokens: int | None
    prompt_tokens: int | None
    ttft_s: float | None
    error: str | None


@dataclass(slots=True)
class LevelResult:
    clients: int
    requests: int
    failed: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    mean_tokens_per_request: float | None
    ttft_mean_s: float | None
    ttft_median_s: float | None
    # Differences of the server's *spec_decode*_total counters over the level ({} when none).
    spec_decode: dict[str, float] = field(default_factory=dict)
    acceptance_rate: float | None = None  # accepted / draft tokens, when both counters exist
    errors: dict[str, int] = field(default_factory=dict)
    per_request: list[RequestRecord] = field(default_factory=list)


def load_workload(path: Path = WORKLOAD) -> list[GroundedPrompt]:
    return [GroundedPrompt(p["id"], p["messages"]) for p in json.loads(path.read_text())]


def client_prompts(num_prompts: int, clients: int, total: int) -> list[list[int]]:
    """Prompt indices each client sends, in order: `total` requests split as evenly as can be,
    client k starting at offset k × ceil(total / clients) and cycling through the prompts."""
    stride = math.ceil(total / clients)
    shares = [total // clients + (1 if k < total % clients else 0) for k in range(clients)]
    return [[(k * stride + j) % num_prompts for j in range(n)] for k, n in enumerate(shares)]


def build_body(cfg: SpecBenchConfig, messages: list[dict]) -> dict:
    body: dict = {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.top_p < 1.0:
        body["top_p"] = cfg.top_p
    return body


async def one_request(
    client: httpx.AsyncClient, cfg: SpecBenchConfig, messages: list[dict]
) -> StreamTiming:
    return await timed_stream(client, "/v1/chat/completions", build_body(cfg, messages))


# ---- spec-decode counters -------------------------------------------------------------------


def spec_counters(metrics_text: str) -> dict[str, float]:
    """Every counter whose name holds "spec_decode" and ends in "_total", summed over its
    series (labels such as model or position)."""
    scrape = parse_metrics(metrics_text)
    return {
        name: scrape.total(name)
        for name in sorted(scrape.samples)
        if "spec_decode" in name and name.endswith("_total")
    }


async def read_spec_counters(client: httpx.AsyncClient) -> dict[str, float] | None:
    """The counters now, or None when the server has no Prometheus /metrics."""
    try:
        response = await client.get("/metrics", timeout=30.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return spec_counters(response.text)


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    if before is None or after is None:
        return {}
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def acceptance_rate(deltas: dict[str, float]) -> float | None:
    """accepted / draft tokens from the counters named *accepted_tokens_total and
    *draft_tokens_total (meterserve's and vLLM's names both end so); None without both."""
    accepted = [v for k, v in deltas.items() if k.endswith("accepted_tokens_total")]
    drafted = [v for k, v in deltas.items() if k.endswith("draft_tokens_total")]
    if len(accepted) != 1 or len(drafted) != 1 or drafted[0] <= 0:
        return None
    return accepted[0] / drafted[0]


# ---- one level ------------------------------------------------------------------------------


async def run_level(
    client: httpx.AsyncClient, cfg: SpecBenchConfig, prompts: list[GroundedPrompt], clients: int
) -> LevelResult:
    plan = client_prompts(len(prompts), clients, cfg.requests_at(clients))
    done: list[tuple[str, StreamTiming]] = []

    async def one_client(indices: list[int]) -> None:
        for i in indices:
            done.append((prompts[i].id, await one_request(client, cfg, prompts[i].messages)))

    before = await read_spec_counters(client)
    start = time.perf_counter()
    await asyncio.gather(*(one_client(indices) for indices in plan if indices))
    wall_s = time.perf_counter() - start
    deltas = counter_deltas(before, await read_spec_counters(client))
    return level_result(clients, done, wall_s, deltas)


def level_result(
    clients: int, done: list[tuple[str, StreamTiming]], wall_s: float, deltas: dict[str, float]
) -> LevelResult:
    records = [
        RequestRecord(id_, t.completion_tokens, t.prompt_tokens, t.ttft, t.failure())
        for id_, t in done
    ]
    ok = [r for r in records if r.error is None]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    tokens = sum(r.completion_tokens or 0 for r in ok)
    ttft = Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None])
    return LevelResult(
        clients=clients,
        requests=len(records),
        failed=len(records) - len(ok),
        wall_s=wall_s,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        mean_tokens_per_request=tokens / len(ok) if ok else None,
        ttft_mean_s=ttft.mean,
        ttft_median_s=ttft.p50,
        spec_decode=deltas,
        acceptance_rate=acceptance_rate(deltas),
        errors=errors,
        per_request=records,
    )


async def run_bench(
    cfg: SpecBenchConfig, prompts: list[GroundedPrompt], log=print
) -> list[LevelResult]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.clients) + 4, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        warm = await one_request(client, cfg, WARM_UP)  # not counted
        if warm.failure() is not None:
            raise RuntimeError(f"warm-up request failed: {warm.failure()}")
        results = []
        for clients in cfg.clients:
            result = await run_level(client, cfg, prompts, clients)
            log(
                f"  {clients:>3} clients: {result.output_tokens_per_s:8.1f} output tok/s "
                f"({result.requests} requests, {result.failed} failed, {result.wall_s:.1f} s)"
            )
            results.append(result)
        return results


# ---- output ---------------------------------------------------------------------------------


def tok_s_ratios(this: dict, other: dict) -> dict[str, float | None]:
    """This run's output tok/s over the other run's, per number of clients both ran (keys are
    the client counts as strings, as JSON keeps them); None where the other run made none."""
    theirs = {lvl["clients"]: lvl["output_tokens_per_s"] for lvl in other.get("levels", [])}
    ratios: dict[str, float | None] = {}
    for lvl in this["levels"]:
        if lvl["clients"] in theirs:
            base = theirs[lvl["clients"]]
            ratios[str(lvl["clients"])] = lvl["output_tokens_per_s"] / base if base else None
    return ratios


def read_run(path: Path) -> dict:
    """A run's JSON: the file's last line (a saved stdout or an --out file)."""
    return json.loads(path.read_text().strip().splitlines()[-1])


def format_table(results: list[LevelResult]) -> str:
    head = (f"{'clients':>7}{'reqs':>6}{'fail':>6}{'out tok/s':>11}{'tok/req':>9}"
            f"{'TTFT mean':>11}{'median':>8}{'drafted':>9}{'accepted':>10}{'accept':>8}")  # fmt: skip
    lines = [head + "   (TTFT in ms)"]
    for r in results:
        drafted = _counter(r.spec_decode, "draft_tokens_total")
        accepted = _counter(r.spec_decode, "accepted_tokens_total")
        rate = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.0%}"
        per_request = (
            "-" if r.mean_tokens_per_request is None else f"{r.mean_tokens_per_request:.1f}"
        )
        lines.append(
            f"{r.clients:>7}{r.requests:>6}{r.failed:>6}{r.output_tokens_per_s:>11.1f}"
            f"{per_request:>9}{_ms(r.ttft_mean_s):>11}{_ms(r.ttft_median_s):>8}"
            f"{drafted:>9}{accepted:>10}{rate:>8}"
        )
    for r in results:
        if any(r.spec_decode.values()):  # a server without drafts shows only zeros
            counts = "  ".join(f"{k}={v:g}" for k, v in r.spec_decode.items())
            lines.append(f"  spec_decode over {r.clients} clients: {counts}")
    return "\n".join(lines)


def _counter(deltas: dict[str, float], suffix: str) -> str:
    values = [v for k, v in deltas.items() if k.endswith(suffix)]
    return f"{values[0]:g}" if len(values) == 1 else "-"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def result_dict(cfg: SpecBenchConfig, label: str, results: list[LevelResult]) -> dict:
    return {
        "label": label,
        "base_url": cfg.base_url,
        "model": cfg.model,
        "workload": WORKLOAD.name,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "levels": [asdict(r) for r in results],
    }


# ---- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.spec_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="default: the first of GET /v1/models")
    p.add_argument("--label", default="", help="name of the server in the output")
    p.add_argument("--clients", default="1,8", help="comma-separated levels")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument(
        "--requests", type=int, default=None, help="per level; default max(6, 2 × clients)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; sent only when < 1")
    p.add_argument("--api-key", default="")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    p.add_argument(
        "--compare", type=Path, nargs="+", default=[], help="other runs' JSON to print ratios to"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    levels = tuple(int(c) for c in args.clients.split(",") if c.strip())
    if not levels or min(levels) < 1 or args.max_tokens < 1 or (args.requests or 1) < 1:
        print(
            "spec_bench: --clients, --max-tokens and --requests must be positive", file=sys.stderr
        )
        return 2
    if not (args.temperature >= 0.0 and 0.0 < args.top_p <= 1.0):
        print("spec_bench: needs --temperature >= 0 and 0 < --top-p <= 1", file=sys.stderr)
        return 2
    others = [(path, read_run(path)) for path in args.compare]  # fail before the run, not after
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or _first_model(args.base_url, headers)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"spec_bench: cannot list models at {args.base_url}: {exc}", file=sys.stderr)
        return 2
    cfg = SpecBenchConfig(
        base_url=args.base_url.rstrip("/"), model=model, clients=levels,
        num_requests=args.requests, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, api_key=args.api_key, timeout_s=args.timeout,
    )  # fmt: skip
    prompts = load_workload()
    label = args.label or cfg.base_url
    decoding = "greedy" if cfg.temperature == 0 else f"temperature {cfg.temperature:g}"
    print(f"spec benchmark: {label}  model={model}  {len(prompts)} grounded prompts, "
          f"max {cfg.max_tokens} tokens, {decoding}")  # fmt: skip
    try:
        results = asyncio.run(run_bench(cfg, prompts))
    except RuntimeError as exc:
        print(f"spec_bench: {exc}", file=sys.stderr)
        return 1
    out = result_dict(cfg, label, results)
    print(format_table(results))
    out["compare"] = []
    for path, other in others:
        ratios = tok_s_ratios(out, other)
        out["compare"].append(
            {"label": other.get("label", ""), "file": str(path), "ratios": ratios}
        )
        shown = "  ".join(f"{c} clients {_ratio(r)}" for c, r in ratios.items())
        print(f"tok/s vs {other.get('label') or path}: {shown or 'no common levels'}")
    line = json.dumps(out, separators=(",", ":"))
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0 if all(r.failed == 0 for r in results) else 1


def _ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}×"


def _first_model(base_url: str, headers: dict[str, str]) -> str:
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
