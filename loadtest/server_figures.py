"""ServerFigures: what the server's own /metrics says happened between two scrapes.

Counters are differenced (after − before); prices and peaks are gauges read after the run.
Names are meterserve's (server/metering/prometheus_export.py, docs/metrics.md). Against a
server without them (a peer), the figures are simply absent. No locust import here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from loadtest.prom import Scrape

P = "meterserve_"
PROMPT_TOKENS = P + "prompt_tokens_total"
CACHED_PROMPT_TOKENS = P + "cached_prompt_tokens_total"
GENERATION_TOKENS = P + "generation_tokens_total"
REQUESTS = P + "requests_total"  # {finished_reason}
REJECTIONS = P + "request_rejections_total"  # {reason}
BUSY_SECONDS = P + "busy_seconds_total"  # {phase}
FLOPS = P + "flops_total"  # {phase}
MEMORY_BYTES = P + "memory_bytes_total"  # {phase}
PREFIX_QUERIES = P + "prefix_cache_queries_total"
PREFIX_HITS = P + "prefix_cache_hits_total"
PREEMPTIONS = P + "preemptions_total"
GOODPUT = P + "goodput_requests_total"
BATCH_SUM = P + "running_batch_size_sum"
BATCH_COUNT = P + "running_batch_size_count"
ENERGY_JOULES = P + "energy_joules_total"
PRICE_PER_SECOND = P + "hardware_price_dollars_per_second"
PRICE_INPUT = P + "price_dollars_per_input_token"
PRICE_OUTPUT = P + "price_dollars_per_output_token"
PEAK_FLOPS = P + "peak_flops_per_second"
PEAK_BANDWIDTH = P + "peak_memory_bandwidth_bytes_per_second"
MAX_NUM_SEQS = P + "max_num_seqs"
CACHE_CONFIG = P + "cache_config_info"


@dataclass(frozen=True, slots=True)
class ServerFigures:
    """Deltas over `wall_s` seconds of server time, and figures derived from them.

    Usage basis charges only busy (step) time; allocation basis charges the whole wall time,
    idle included. Cost per 1M tokens divides by prompt + generated tokens.
    """

    wall_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    generation_tokens: int
    requests_by_reason: dict[str, int]
    rejections_by_reason: dict[str, int]
    busy_prefill_s: float
    busy_decode_s: float
    utilization: float  # busy / wall
    hardware_price_per_hour: float
    cost_usage_usd: float
    cost_allocation_usd: float
    cost_per_1m_tokens_usage: float | None
    cost_per_1m_tokens_allocation: float | None
    cost_per_1m_prompt_tokens_usage: float | None  # prefill busy time / prompt tokens
    cost_per_1m_output_tokens_usage: float | None  # decode busy time / generated tokens
    revenue_usd: float  # at the configured list prices
    mfu: float | None  # achieved FLOP/s over the wall time / peak FLOP/s
    mbu: float | None  # achieved bytes/s over the wall time / peak bandwidth
    mean_batch_size: float | None
    max_num_seqs: int | None
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    goodput_requests: int
    energy_joules: float | None

    @property
    def busy_s(self) -> float:
        return self.busy_prefill_s + self.busy_decode_s

    def to_dict(self) -> dict:
        return asdict(self)


def server_figures(before: Scrape, after: Scrape) -> ServerFigures | None:
    """None when the server exports no meterserve counters (another server)."""
    if not after.has(GENERATION_TOKENS):
        return None
    wall = max(after.taken_at - before.taken_at, 1e-9)

    def delta(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    def delta_by(name: str, label: str) -> dict[str, int]:
        old = before.by_label(name, label)
        return {k: round(v - old.get(k, 0.0)) for k, v in after.by_label(name, label).items()}

    prompt, generated = round(delta(PROMPT_TOKENS)), round(delta(GENERATION_TOKENS))
    prefill_s, decode_s = delta(BUSY_SECONDS, phase="prefill"), delta(BUSY_SECONDS, phase="decode")
    price_s = after.total(PRICE_PER_SECOND)
    cost_usage, cost_alloc = (prefill_s + decode_s) * price_s, wall * price_s
    tokens = prompt + generated
    batches = delta(BATCH_COUNT)
    return ServerFigures(
        wall_s=wall,
        prompt_tokens=prompt,
        cached_prompt_tokens=round(delta(CACHED_PROMPT_TOKENS)),
        generation_tokens=generated,
        requests_by_reason={k: v for k, v in delta_by(REQUESTS, "finished_reason").items() if v},
        rejections_by_reason={k: v for k, v in delta_by(REJECTIONS, "reason").items() if v},
        busy_prefill_s=prefill_s,
        busy_decode_s=decode_s,
        utilization=(prefill_s + decode_s) / wall,
        hardware_price_per_hour=price_s * 3600.0,
        cost_usage_usd=cost_usage,
        cost_allocation_usd=cost_alloc,
        cost_per_1m_tokens_usage=_per_million(cost_usage, tokens),
        cost_per_1m_tokens_allocation=_per_million(cost_alloc, tokens),
        cost_per_1m_prompt_tokens_usage=_per_million(prefill_s * price_s, prompt),
        cost_per_1m_output_tokens_usage=_per_million(decode_s * price_s, generated),
        revenue_usd=prompt * after.total(PRICE_INPUT) + generated * after.total(PRICE_OUTPUT),
        mfu=_ratio(delta(FLOPS) / wall, after.total(PEAK_FLOPS)),
        mbu=_ratio(delta(MEMORY_BYTES) / wall, after.total(PEAK_BANDWIDTH)),
        mean_batch_size=delta(BATCH_SUM) / batches if batches else None,
        max_num_seqs=round(after.total(MAX_NUM_SEQS)) if after.has(MAX_NUM_SEQS) else None,
        prefix_cache_queried_tokens=round(delta(PREFIX_QUERIES)),
        prefix_cache_hit_tokens=round(delta(PREFIX_HITS)),
        preemptions=round(delta(PREEMPTIONS)),
        goodput_requests=round(delta(GOODPUT)),
        energy_joules=delta(ENERGY_JOULES) if after.has(ENERGY_JOULES) else None,
    )


def _per_million(dollars: float, tokens: int) -> float | None:
    return dollars / tokens * 1e6 if tokens else None


def _ratio(achieved: float, peak: float) -> float | None:
    return achieved / peak if peak > 0 else None
