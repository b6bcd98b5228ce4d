"""The real server scraped by a real Prometheus: every shipped PromQL expression evaluated.

Starts `meterserve serve` on the default model with three tenants (an API-keys file) and
`prometheus` (scrape and rule evaluation every 1 s, the repository's rule files; the scrape
sends --metrics-api-key from a credentials file, as deploy/prometheus/prometheus.yml
describes, since with keys /metrics shows the tenant series only to that key), drives the
traffic real clients send (chat and completions, streamed with include_usage or not, stop
strings that hit, n=2, sampled with seeds, clients that disconnect mid-stream), then checks
that the meter is exact (token counters == the usage returned to clients, requests by
finish_reason == the clients' finish reasons, cost == Σ cost_usd, per tenant too; attributed
busy time == engine busy time), that a single stream's decode passes count no more bytes
than its weights and KV, and that every dashboard panel and recording rule evaluates to a
non-empty, finite, plausible value, and every alert expression evaluates without error.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from meter_queries import RULE_FILES, Query, dashboard_queries, rule_queries
from prometheus_client.parser import text_string_to_metric_families

from engine.model_runner import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meterserve-e2e"
METRICS_KEY = "sk-e2e-metrics"
# Window the tests substitute for $__rate_interval (meter_queries.GRAFANA_VARIABLES).
LOAD_TIMEOUT_S = 120.0  # model load; about 20 s on a busy 2-core machine
pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(process: subprocess.Popen, log: Path) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    sys.stderr.write(f"--- {log.name} (tail) ---\n{log.read_text()[-3000:]}\n")


@dataclass(slots=True)
class Stack:
    server_url: str
    prometheus_url: str
    server_log: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, prometheus_binary) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("meter_e2e")
    server_port, prometheus_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("METERSERVE_")}
    server_log = tmp / "server.log"
    keys_file = tmp / "tenants.yaml"
    keys_file.write_text(yaml.safe_dump({"tenants": TENANTS}))
    server = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "meterserve"), "serve", "--host", "127.0.0.1",
         "--port", str(server_port), "--served-model-name", MODEL, "--max-num-seqs", "16",
         "--kv-cache-bytes", "64MiB", "--api-keys-file", str(keys_file),
         "--metrics-api-key", METRICS_KEY],
        cwd=ROOT, env=env, stdout=server_log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    (tmp / "metrics-api-key").write_text(METRICS_KEY + "\n")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in RULE_FILES],
        "scrape_configs": [
            {
                "job_name": "meterserve",
                "static_configs": [{"targets": [f"127.0.0.1:{server_port}"]}],
                "authorization": {"credentials_file": str(tmp / "metrics-api-key")},
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus_log = tmp / "prometheus.log"
    prometheus = subprocess.Popen(
        [prometheus_binary, f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prometheus_port}"],
        stdout=prometheus_log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        stack = Stack(
            f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{prometheus_port}", server_log
        )
        _wait_until_ready(stack, server, prometheus)
        yield stack
    finally:
        _stop(server, server_log)
        _stop(prometheus, prometheus_log)


def _wait_until_ready(stack: Stack, server: subprocess.Popen, prometheus: subprocess.Popen):
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while True:
        assert server.poll() is None, f"server exited:\n{stack.server_log.read_text()[-3000:]}"
        assert prometheus.poll() is None, "prometheus exited"
        if _get_ok(f"{stack.server_url}/health") and _prometheus_up(stack):
            return
        assert time.monotonic() < deadline, "server or Prometheus not ready in time"
        time.sleep(0.5)


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _prometheus_up(stack: Stack) -> bool:
    """Prometheus has scraped a loaded server (so every counter series starts before load)."""
    try:
        result = _query(stack, 'meterserve_tenant_prompt_tokens_total{tenant="acme"}')
    except (httpx.HTTPError, AssertionError):
        return False
    return len(result) == 1


def _query(stack: Stack, expr: str) -> list[dict]:
    response = httpx.get(f"{stack.prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert body.get("status") == "success", f"{expr!r}: {body}"
    assert body["data"]["resultType"] == "vector", expr
    return body["data"]["result"]


def _scrape(stack: Stack) -> tuple[str, dict[tuple[str, frozenset], float]]:
    headers = {"Authorization": f"Bearer {METRICS_KEY}"}
    text = httpx.get(f"{stack.server_url}/metrics", headers=headers, timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "model")
            samples[(sample.name, labels)] = sample.value
    return text, samples


def _total(samples, name: str) -> float:
    return sum(value for (sample_name, _), value in samples.items() if sample_name == name)


# ---- load -------------------------------------------------------------------------------------

# acme has its own price plan; beta pays the list prices; gamma's clients disconnect.
TENANTS = {
    "acme": {
        "keys": ["sk-acme"],
        "price_per_million_input_tokens": 0.2,
        "price_per_million_output_tokens": 0.6,
    },
    "beta": {"keys": ["sk-beta"]},
    "gamma": {"keys": ["sk-gamma"]},
}
BILLED_TENANTS = ("acme", "beta")

PROMPTS = [
    "Write one sentence about the sea.",
    "List three colors:",
    "The capital of France is",
    "Explain in a few words why the sky is blue.",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "Translate to French: good morning, how are you today?",
]


@dataclass(slots=True)
class ClientTally:
    """What the clients were told: every usage object and every choice's finish_reason."""

    usages: dict[int, dict] = field(default_factory=dict)  # by request index
    finish_reasons: list[str] = field(default_factory=list)
    # The disconnected (gamma) clients get no usage: their prompts' token counts come from
    # /tokenize, and the text chunks each read before leaving bound what was delivered.
    gamma_prompt_tokens: int = 0
    gamma_chunks_read: int = 0

    def sum(self, key: str) -> float:
        return sum(usage[key] for usage in self.usages.values())

    def cached(self) -> int:
        return sum(u["prompt_tokens_details"]["cached_tokens"] for u in self.usages.values())


def _body(index: int) -> tuple[str, dict]:
    """Request `index` of the mix: chat or completions, streamed or not, greedy or sampled
    with a seed, a stop string that hits, n=2."""
    prompt = PROMPTS[index % len(PROMPTS)]
    chat, stream = index % 2 == 0, index % 3 == 0
    body: dict = {"model": MODEL, "max_tokens": 6 + index % 3 * 2}
    if index % 4 == 1:
        body.update(temperature=0.8, top_p=0.95, seed=index)
    else:
        body["temperature"] = 0
    if index % 5 == 2:
        body.update(n=2, temperature=0.9, seed=100 + index)
    if index % 4 == 3:
        body.update(stop=[",", ".", " "], max_tokens=24)  # hits within a few tokens
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def _one_request(client: httpx.AsyncClient, index: int, tally: ClientTally) -> None:
    path, body = _body(index)
    key = f"sk-{BILLED_TENANTS[index % 2]}"
    headers = {"Authorization": f"Bearer {key}", "X-Tenant": "gamma"}  # header not configured
    if not body.get("stream"):
        response = await client.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        payload = response.json()
        tally.usages[index] = payload["usage"]
        tally.finish_reasons.extend(choice["finish_reason"] for choice in payload["choices"])
        return
    usage, reasons = None, {}
    async with client.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        reasons[choice["index"]] = choice["finish_reason"]
    assert usage is not None, "stream ended without a usage chunk"
    tally.usages[index] = usage
    tally.finish_reasons.extend(reasons.values())


async def _disconnect(client: httpx.AsyncClient, index: int, tally: ClientTally) -> None:
    """A gamma client that reads a few chunks of a long stream, then leaves."""
    prompt = PROMPTS[index % len(PROMPTS)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": DISCONNECT_MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    headers = {"Authorization": "Bearer sk-gamma"}
    tokens = await client.post("/tokenize", json={"prompt": prompt}, headers=headers)
    tally.gamma_prompt_tokens += len(tokens.json()["tokens"])
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                seen += 1  # a chunk with text carries at least one delivered token
            if seen >= 4:
                break  # leaving the block closes the connection mid-stream
        tally.gamma_chunks_read += seen


NUM_REQUESTS = 16
NUM_DISCONNECTS = 2
DISCONNECT_MAX_TOKENS = 400


async def _drive_load(server_url: str) -> ClientTally:
    """Two waves of 8 billed requests (the second repeats the first's prompts, so the prefix
    cache gets hits) with a disconnecting client beside each wave."""
    tally = ClientTally()
    async with httpx.AsyncClient(base_url=server_url, timeout=120) as client:
        for wave in range(2):
            await asyncio.gather(
                *(_one_request(client, wave * 8 + i, tally) for i in range(8)),
                _disconnect(client, wave, tally),
            )
    return tally


def _wait_for_settlements(stack: Stack, num_choices: int) -> None:
    """The disconnected streams settle when their aborts are acknowledged: wait for them."""
    deadline = time.monotonic() + 30
    while True:
        _, samples = _scrape(stack)
        if _total(samples, "meterserve_requests_total") >= num_choices:
            return
        assert time.monotonic() < deadline, "requests did not settle"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def loaded(stack):
    _, before = _scrape(stack)
    started = time.monotonic()
    tally = asyncio.run(_drive_load(stack.server_url))
    load_seconds = time.monotonic() - started
    before_total = _total(before, "meterserve_requests_total")
    _wait_for_settlements(stack, before_total + len(tally.finish_reasons) + NUM_DISCONNECTS)
    text, after = _scrape(stack)
    # Wait until Prometheus has scraped the final counters and evaluated the rules on them.
    final = _total(after, "meterserve_generation_tokens_total")
    deadline = time.monotonic() + 15
    while True:
        result = _query(stack, "sum(meterserve_generation_tokens_total)")
        if result and float(result[0]["value"][1]) == final:
            break
        assert time.monotonic() < deadline, "Prometheus did not scrape the final counters"
        time.sleep(0.5)
    time.sleep(2.5)  # > 2 rule evaluations, so chained recording rules are up to date too
    sys.stderr.write(f"load: {len(tally.usages)} requests in {load_seconds:.1f}s\n")
    return {"tally": tally, "before": before, "after": after, "text": text}


# ---- the meter is exact ----------------------------------------------------------------------


def _delta(loaded, name: str, **labels: str) -> float:
    def total(samples) -> float:
        return sum(
            value
            for (sample_name, sample_labels), value in samples.items()
            if sample_name == name and set(labels.items()) <= sample_labels
        )

    return total(loaded["after"]) - total(loaded["before"])


def _tenant_tally(tally: ClientTally, tenant: str) -> ClientTally:
    """The requests of one tenant: _one_request alternates acme / beta by index."""
    mine = ClientTally()
    for i, usage in tally.usages.items():
        if BILLED_TENANTS[i % 2] == tenant:
            mine.usages[i] = usage
    return mine


def test_the_mix_covered_what_it_is_meant_to(loaded):
    tally: ClientTally = loaded["tally"]
    assert len(tally.usages) == NUM_REQUESTS
    assert "stop" in tally.finish_reasons and "length" in tally.finish_reasons
    # Every request with stop strings ended on one, well before its max_tokens.
    for index, usage in tally.usages.items():
        _, body = _body(index)
        if body.get("stop"):
            assert usage["completion_tokens"] < body["max_tokens"], (index, usage)
    # Tokens the engine computed past a stop or a departed client are counted only when it
    # ran ahead of the server before the abort arrived (a race), but never more than the
    # choices could still have produced: their max_tokens less what they delivered.
    room = sum(
        _body(index)[1].get("n", 1) * _body(index)[1]["max_tokens"] - usage["completion_tokens"]
        for index, usage in tally.usages.items()
    )
    gamma_delivered = _delta(loaded, "meterserve_tenant_generation_tokens_total", tenant="gamma")
    room += NUM_DISCONNECTS * DISCONNECT_MAX_TOKENS - gamma_delivered
    assert 0 <= _delta(loaded, "meterserve_undelivered_tokens_total") <= room


def test_token_counters_equal_the_usage_returned_to_clients(loaded):
    """Every identity against what the clients were told or can count themselves: the usage
    objects, and for the disconnected gamma clients /tokenize's count of their prompts and
    the chunks they read (each delivered at least one token before they left)."""
    tally: ClientTally = loaded["tally"]
    gamma = {"tenant": "gamma"}
    assert _delta(loaded, "meterserve_tenant_prompt_tokens_total", **gamma) == (
        tally.gamma_prompt_tokens
    )
    assert _delta(loaded, "meterserve_prompt_tokens_total") == (
        tally.sum("prompt_tokens") + tally.gamma_prompt_tokens
    )
    gamma_delivered = _delta(loaded, "meterserve_tenant_generation_tokens_total", **gamma)
    assert tally.gamma_chunks_read <= gamma_delivered < NUM_DISCONNECTS * DISCONNECT_MAX_TOKENS
    assert _delta(loaded, "meterserve_generation_tokens_total") == (
        tally.sum("completion_tokens") + gamma_delivered
    )
    # gamma's two prompts differ and are its own: with the cache keyed by tenant, gamma is
    # told of no hit, and every cached token counted is one a billed client was told of.
    assert _delta(loaded, "meterserve_tenant_cached_prompt_tokens_total", **gamma) == 0
    assert _delta(loaded, "meterserve_cached_prompt_tokens_total") == tally.cached()


def test_requests_by_finish_reason_are_the_clients_finish_reasons(loaded):
    tally: ClientTally = loaded["tally"]
    for reason in ("stop", "length", "abort", "timeout", "error"):
        expected = tally.finish_reasons.count(reason)
        if reason == "abort":
            expected += NUM_DISCONNECTS
        counted = _delta(loaded, "meterserve_requests_total", finished_reason=reason)
        assert counted == expected, reason
    gamma = _delta(loaded, "meterserve_tenant_requests_total", tenant="gamma")
    assert gamma == _delta(
        loaded, "meterserve_tenant_requests_total", tenant="gamma", finished_reason="abort"
    )
    assert gamma == NUM_DISCONNECTS


def test_each_tenants_counters_equal_its_usage(loaded):
    tally: ClientTally = loaded["tally"]
    for tenant in BILLED_TENANTS:
        mine = _tenant_tally(tally, tenant)
        labels = {"tenant": tenant}
        assert _delta(loaded, "meterserve_tenant_prompt_tokens_total", **labels) == mine.sum(
            "prompt_tokens"
        )
        assert _delta(loaded, "meterserve_tenant_generation_tokens_total", **labels) == mine.sum(
            "completion_tokens"
        )
        assert _delta(loaded, "meterserve_tenant_cost_dollars_total", **labels) == pytest.approx(
            mine.sum("cost_usd"), rel=1e-9
        )
        assert _delta(loaded, "meterserve_tenant_revenue_dollars_total", **labels) == pytest.approx(
            mine.sum("revenue_usd"), rel=1e-9
        )
    # acme's own prices: $0.2 / $0.6 per 1M tokens.
    acme = _tenant_tally(tally, "acme")
    expected = (acme.sum("prompt_tokens") * 0.2 + acme.sum("completion_tokens") * 0.6) / 1e6
    assert acme.sum("revenue_usd") == pytest.approx(expected, rel=1e-9)


def test_costs_add_up_to_engine_busy_time(loaded):
    tally: ClientTally = loaded["tally"]
    price = _total(loaded["after"], "meterserve_hardware_price_dollars_per_second")
    gamma_cost = _delta(loaded, "meterserve_tenant_cost_dollars_total", tenant="gamma")
    # The cost histogram has one observation per API request: its sum is Σ cost_usd.
    cost_sum = _delta(loaded, "meterserve_request_cost_dollars_sum")
    assert cost_sum == pytest.approx(tally.sum("cost_usd") + gamma_cost, rel=1e-9)
    assert _delta(loaded, "meterserve_request_cost_dollars_count") == (
        NUM_REQUESTS + NUM_DISCONNECTS
    )
    attributed = tally.sum("prefill_seconds") + tally.sum("decode_seconds") + gamma_cost / price
    engine = _delta(loaded, "meterserve_busy_seconds_total")
    assert engine > 0
    assert attributed == pytest.approx(engine, rel=0.01)
    # And each request's cost is its busy time at the configured price.
    busy = tally.sum("prefill_seconds") + tally.sum("decode_seconds")
    assert tally.sum("cost_usd") == pytest.approx(busy * price, rel=1e-6)


def test_an_unknown_key_is_refused_and_the_tenant_header_is_ignored(stack, loaded):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    url = f"{stack.server_url}/v1/completions"
    response = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-nobody"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    # Without --tenant-header the header names nobody: _one_request sent X-Tenant: gamma
    # with acme's and beta's keys, yet gamma was billed only its disconnected streams.
    assert _delta(loaded, "meterserve_tenant_requests_total", tenant="gamma") == NUM_DISCONNECTS


def test_only_the_metrics_key_scrapes_the_tenant_series(stack):
    """Prometheus has them (its scrape sends the metrics key); a scrape without it, or with
    a tenant's own key, gets the aggregates only (docs/metrics.md#what-answers-without-a-key)."""
    for headers in ({}, {"Authorization": "Bearer sk-acme"}):
        text = httpx.get(f"{stack.server_url}/metrics", headers=headers, timeout=10).text
        assert "meterserve_generation_tokens_total" in text
        assert "tenant=" not in text, headers
    assert 'tenant="acme"' in _scrape(stack)[0]


def test_a_single_streams_decode_passes_count_no_more_bytes_than_they_read(stack, loaded):
    """The meter reads no more than the kernels: per decode pass, bytes <= the weights the pass reads
    (the small-batch path: the GGUF blocks) + its KV read and write + one embedding row."""
    _, before = _scrape(stack)
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    headers = {"Authorization": "Bearer sk-beta"}
    response = httpx.post(
        f"{stack.server_url}/v1/completions", json=body, headers=headers, timeout=120
    )
    assert response.status_code == 200
    usage = response.json()["usage"]
    _, after = _scrape(stack)

    def delta(name: str, **labels: str) -> float:
        return _delta({"before": before, "after": after}, name, **labels)

    passes = delta("meterserve_forward_passes_total", phase="decode")
    assert passes == usage["completion_tokens"] - 1  # the first token comes from prefill
    per_pass = delta("meterserve_memory_bytes_total", phase="decode") / passes
    weights = _total(
        {k: v for k, v in after.items() if ("path", "small_batch") in k[1]},
        "meterserve_model_weight_bytes",
    )
    # SmolLM2-135M: 30 layers x K,V x 3 KV heads x 64 dims x 2 bytes = 23,040 bytes per token
    # in bf16; 4 bytes an element where the server's dtype "auto" is float32 (no AVX512-BF16).
    element = torch.empty(0, dtype=resolve_dtype("auto")).element_size()
    kv_per_token = 30 * 2 * 3 * 64 * element
    context = usage["prompt_tokens"] + usage["completion_tokens"]
    bound = weights + (context + 1) * kv_per_token + 576 * element
    assert 0 < per_pass <= bound, (per_pass, weights, bound)
    # MBU itself is not asserted below 1: the 96 MB model fits in the last-level cache, so a
    # pass can read faster than the measured DRAM peak (docs/metrics.md says so).
    assert _total(after, "meterserve_peak_memory_bandwidth_bytes_per_second") > 0


def test_promtool_check_metrics_on_the_live_endpoint(loaded, promtool):
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=loaded["text"].encode(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


# ---- every shipped expression, evaluated --------------------------------------------------------


def _energy_available(stack: Stack) -> bool:
    result = _query(stack, "max(meterserve_energy_available)")
    assert result, "meterserve_energy_available missing"
    return float(result[0]["value"][1]) == 1.0


def _values(result: list[dict]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


def _check_plausible(query: Query, values: list[float], tally: ClientTally) -> None:
    name = query.name
    if "cost_dollars_per_million" in name or name.startswith("Cost per"):
        assert all(v > 0 for v in values), (query.source, values)
    if name in ("meterserve:mfu:ratio_rate1m", "meterserve:mbu:ratio_rate1m") or name.startswith(
        ("MFU", "MBU")
    ):
        assert all(0 < v < 1 for v in values), (query.source, values)
    if name == "meterserve:tenant_margin:ratio_rate1m" or name.startswith("Margin"):
        assert all(v <= 1 for v in values), (query.source, values)  # negative = a loss
    elif name.endswith(("ratio_rate1m", "ratio_rate5m", ":ratio", "share_rate1m")):
        assert all(0 <= v <= 1 for v in values), (query.source, values)
    if name in ("Time to first token", "End-to-end latency", "Step duration"):
        assert all(v > 0 for v in values), (query.source, values)
    if name == "Revenue vs cost ($/hour)":
        assert all(v > 0 for v in values), (query.source, values)


def _check_counters_scraped_exactly(stack: Stack) -> None:
    """Prometheus stores the token counters exactly as the server exports them (exact counter
    values, never rate() x window, which extrapolates and can flake on a slow machine)."""
    _, now = _scrape(stack)  # the server is idle: these no longer move
    for counter in ("meterserve_prompt_tokens_total", "meterserve_generation_tokens_total"):
        deadline = time.monotonic() + 15
        while True:
            (stored,) = _values(_query(stack, f"sum({counter})"))
            if stored == _total(now, counter):
                break
            assert time.monotonic() < deadline, (counter, stored, _total(now, counter))
            time.sleep(0.5)


HEADLINE = (
    "meterserve:cost_dollars_per_million_input_tokens:usage_rate1m",
    "meterserve:cost_dollars_per_million_output_tokens:usage_rate1m",
    "meterserve:cost_dollars_per_million_output_tokens:allocation_rate1m",
    "meterserve:mfu:ratio_rate1m",
    "meterserve:mbu:ratio_rate1m",
)


def test_every_dashboard_and_rule_expression_evaluates_to_plausible_values(stack, loaded):
    tally: ClientTally = loaded["tally"]
    energy = _energy_available(stack)
    queries = dashboard_queries() + rule_queries()
    assert len(queries) > 60
    failures = []
    for query in queries:
        try:
            result = _query(stack, query.expr)
            values = _values(result)
            assert all(not math.isnan(v) and not math.isinf(v) for v in values), values
            if query.kind == "alert":
                continue  # a healthy server need not fire; evaluating without error is the test
            if "energy_joules" in query.expr:
                # Present exactly where a real energy counter is readable, never made up.
                assert bool(values) == energy, (energy, values)
                continue
            assert values, "no samples"
            _check_plausible(query, values, tally)
        except AssertionError as exc:
            failures.append(f"{query.source}\n    {query.expr}\n    -> {exc}")
    assert not failures, "\n".join(failures)
    _check_counters_scraped_exactly(stack)
    for name in HEADLINE:  # what the cost dashboard shows for this run (pytest -s to see)
        (value,) = _values(_query(stack, name))
        sys.stderr.write(f"{name} = {value:.6g}\n")


def test_prometheus_loaded_every_rule_and_evaluates_them_without_error(stack, loaded):
    body = httpx.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10).json()
    rules = [rule for group in body["data"]["groups"] for rule in group["rules"]]
    assert len(rules) == len(rule_queries())
    unhealthy = [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
    assert not unhealthy
