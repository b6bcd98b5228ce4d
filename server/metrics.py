"""ServerMetrics: the meter's readings as Prometheus metrics. It exports; it computes nothing
that clients are told (costs and bills come from engine/meter).

The only prometheus_client importer in the repository. Conventions: prefix `meterserve_`,
base units (seconds, bytes, joules, dollars), `_total` counters, `_ratio` for 0..1, and only
bounded labels: model, phase, finished_reason, reason, tenant (configured names, "default"
or "other"), path (plus the fixed facts block_size, num_blocks and source on info-style
gauges). docs/metrics.md lists every metric.

Two registries: `registry` holds the aggregate series, `tenant_registry` the per-tenant ones
(server/tenant_metrics.py: who is billed what), so /metrics can render the aggregates alone
for a scrape that may not see other tenants' bills (server/routes/metrics.py).

Three feeds, each under one lock so a scrape is a consistent snapshot:
- observe_step / observe_event (engine thread): work done, latencies at the moment tokens
  are produced (TTFT at the first token);
- observe_delivered (loop thread): output tokens as they go into responses;
- observe_settlement (loop thread): one finished API request's bill, exactly once.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from engine.meter.energy import EnergyMeter
from engine.meter.meter import Meter
from engine.stats import KVCacheInfo, StepStats
from scheduler.output import TokenEvent
from server.energy_collector import EnergyCollector
from server.live_window import LiveFacts, LiveWindow
from server.request_group import Settlement
from server.tenant_metrics import TenantMetrics

PREFIX = "meterserve_"
PHASES = ("prefill", "decode")
# Requests that ended normally; aborts, timeouts and errors never count as goodput.
COMPLETED_REASONS = ("stop", "length", "tool_calls")
FINISHED_REASONS = (*COMPLETED_REASONS, "abort", "timeout", "error")
# A request that ended without a first token misses the TTFT SLO when the server failed it or
# when it waited past the SLO; a client that gave up sooner tells nothing about the server.
FAILED_REASONS = ("timeout", "error")

# Latency buckets (seconds); the configured SLO is added to each latency histogram.
# fmt: off
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 5, 7.5, 10, 15, 20,
                30, 60)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1,
               2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 120, 300)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1,
                2, 5)
# fmt: on
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Dollars per request, 1e-8 .. 1e-2 in 1-2.5-5 steps.
COST_BUCKETS = tuple(m * 10.0**e for e in range(-8, -2) for m in (1, 2.5, 5)) + (1e-2,)


def slo_buckets(buckets: tuple[float, ...], slo: float) -> tuple[float, ...]:
    """The buckets plus the SLO itself, so 'fraction within SLO' is an exact bucket ratio."""
    return tuple(sorted({float(b) for b in buckets} | {float(slo)}))


class ServerMetrics:
    """Owns a registry of meterserve metrics and updates it from the meter's readings.

    observe_step/observe_event run on the engine thread, observe_delivered/observe_settlement
    and render() on the asyncio thread; one lock makes every scrape a consistent snapshot.
    """

    def __init__(
        self,
        meter: Meter,
        model_name: str,
        kv_cache_info: KVCacheInfo,
        num_params: int,
        registry: CollectorRegistry | None = None,
        *,
        max_num_seqs: int | None = None,
        energy_meter: EnergyMeter | None = None,
        tenants: tuple[str, ...] = ("default",),
    ) -> None:
        self.meter = meter
        self.slo = meter.config
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenant_registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._energy = energy_meter if energy_meter is not None else EnergyMeter.detect()
        self._define_traffic()
        self.tenants = TenantMetrics(self.tenant_registry, model_name, tenants, FINISHED_REASONS)
        self._define_queue(kv_cache_info, max_num_seqs)
        self._define_latency()
        self._define_cost()
        self._set_constants(num_params)
        self.live = LiveWindow(
            _live_facts(meter, model_name, num_params, max_num_seqs, kv_cache_info)
        )
        self.registry.register(EnergyCollector(self._energy, model_name))
        ProcessCollector(registry=self.registry)

    # ---- definitions ----------------------------------------------------------------------

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, ("model", *labels), registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, ("model", *labels), registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        metric = Histogram(PREFIX + name, doc, ("model",), buckets=buckets, registry=self.registry)
        return metric.labels(model=self.model_name)

    def _by_phase(self, metric: Counter) -> dict[str, Any]:
        return {phase: metric.labels(model=self.model_name, phase=phase) for phase in PHASES}

    def _define_traffic(self) -> None:
        m = self.model_name
        self.requests = self._counter(
            "requests",
            "Finished engine requests (choices) by the finish_reason their client got.",
            ("finished_reason",),
        )
        for reason in FINISHED_REASONS:
            self.requests.labels(model=m, finished_reason=reason)
        self.rejections = self._counter(
            "request_rejections", "Requests refused at admission, by reason.", ("reason",)
        )
        self.prompt_tokens = self._counter(
            "prompt_tokens", "Prompt tokens billed (usage.prompt_tokens; each prompt once)."
        ).labels(m)
        self.cached_prompt_tokens = self._counter(
            "cached_prompt_tokens", "Billed prompt tokens served from the prefix cache."
        ).labels(m)
        self.generation_tokens = self._counter(
            "generation_tokens", "Output tokens delivered in responses (usage.completion_tokens)."
        ).labels(m)
        self.undelivered_tokens = self._counter(
            "undelivered_tokens",
            "Output tokens computed but never delivered (after a stop string matched, or after "
            "the client left or timed out); in the cost, not billed.",
        ).labels(m)
        self.computed_tokens = self._by_phase(
            self._counter("computed_tokens", "Tokens run through the model, by phase.", ("phase",))
        )
        self.forward_passes = self._by_phase(
            self._counter(
                "forward_passes",
                "Forward passes that contained tokens of the phase (a mixed step counts in both).",
                ("phase",),
            )
        )

    def _define_queue(self, kv: KVCacheInfo, max_num_seqs: int | None) -> None:
        m = self.model_name
        self.num_waiting = self._gauge("num_requests_waiting", "Requests waiting.").labels(m)
        self.num_running = self._gauge("num_requests_running", "Requests in the batch.").labels(m)
        self.kv_cache_usage = self._gauge(
            "kv_cache_usage_ratio", "KV cache blocks in use / total blocks."
        ).labels(m)
        self._gauge(
            "cache_config_info", "KV cache configuration (value 1).", ("block_size", "num_blocks")
        ).labels(m, str(kv.block_size), str(kv.num_blocks)).set(1)
        self._gauge("kv_cache_capacity_tokens", "Tokens the KV cache holds.").labels(m).set(
            kv.max_tokens
        )
        if max_num_seqs is not None:
            self._gauge("max_num_seqs", "Cap on requests in the running batch.").labels(m).set(
                max_num_seqs
            )
        self.batch_size = self._histogram(
            "running_batch_size", "Requests in each step's forward batch.", BATCH_BUCKETS
        )
        self.preemptions = self._counter("preemptions", "Requests preempted.").labels(m)
        self.window_freed_blocks = self._counter(
            "window_freed_blocks",
            "KV blocks freed behind a sliding window while their request ran.",
        ).labels(m)
        self.prefix_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(m)

    def _define_latency(self) -> None:
        m, slo = self.model_name, self.slo
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Arrival to first token, observed when the first token is produced.",
            slo_buckets(TTFT_BUCKETS, slo.slo_ttft_seconds),
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            slo_buckets(ITL_BUCKETS, slo.slo_itl_seconds),
        )
        self.tpot = self._histogram(
            "time_per_output_token_seconds",
            "Mean inter-token latency of a finished request (first to last token).",
            slo_buckets(ITL_BUCKETS, slo.slo_itl_seconds),
        )
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", QUEUE_BUCKETS
        )
        self.step_duration = self._histogram(
            "step_duration_seconds", "Wall time of one engine step.", STEP_BUCKETS
        )
        self.goodput = self._counter(
            "goodput_requests", "Completed requests that met the TTFT and TPOT SLOs."
        ).labels(m)
        self.ttft_judged = self._counter(
            "slo_ttft_requests",
            "Requests judged against the TTFT SLO: each first token, and each request that "
            "ended without one by error or timeout, or after waiting longer than the SLO.",
        ).labels(m)
        self.ttft_misses = self._counter(
            "slo_ttft_misses",
            "Judged requests without a first token within the TTFT SLO.",
        ).labels(m)

    def _define_cost(self) -> None:
        self.busy_seconds = self._by_phase(
            self._counter("busy_seconds", "Engine step time, split by roofline share.", ("phase",))
        )
        self.flops = self._by_phase(
            self._counter("flops", "Estimated floating-point operations.", ("phase",))
        )
        self.memory_bytes = self._by_phase(
            self._counter(
                "memory_bytes",
                "Estimated bytes moved (weights in the format read, KV read and written).",
                ("phase",),
            )
        )
        self.request_cost = self._histogram(
            "request_cost_dollars", "Usage-basis hardware cost of one API request.", COST_BUCKETS
        )

    def _set_constants(self, num_params: int) -> None:
        m, meter = self.model_name, self.slo
        gauges = {
            "model_parameters": ("Parameters of the served model.", num_params),
            "slo_ttft_seconds": ("Configured time-to-first-token SLO.", meter.slo_ttft_seconds),
            "slo_itl_seconds": ("Configured inter-token latency SLO.", meter.slo_itl_seconds),
            "hardware_price_dollars_per_second": (
                "Configured price of this replica's hardware.",
                meter.hardware_price_per_second,
            ),
            "price_dollars_per_input_token": (
                "Default list price charged per prompt token.",
                meter.price_per_million_input_tokens / 1e6,
            ),
            "price_dollars_per_output_token": (
                "Default list price charged per generated token.",
                meter.price_per_million_output_tokens / 1e6,
            ),
            "cost_ceiling_dollars_per_output_token": (
                "Alert threshold for the allocation-basis cost of a generated token.",
                meter.cost_ceiling_per_million_output_tokens / 1e6,
            ),
        }
        for name, (doc, value) in gauges.items():
            self._gauge(name, doc).labels(m).set(value)
        weights = self.meter.cost_model.weight_bytes
        weight_bytes = self._gauge(
            "model_weight_bytes",
            "Bytes of weights one forward pass reads, by kernel path (small_batch: matvecs of "
            "few rows, in the stored format; large_batch: matmuls over bf16/float32).",
            ("path",),
        )
        weight_bytes.labels(m, "small_batch").set(weights.body_small + weights.head_small)
        weight_bytes.labels(m, "large_batch").set(weights.body_large + weights.head_large)
        peaks = self.meter.peaks
        self._gauge("peak_flops_per_second", "Peak FLOP/s used for MFU.", ("source",)).labels(
            m, peaks.flops_source
        ).set(peaks.flops_per_second)
        self._gauge(
            "peak_memory_bandwidth_bytes_per_second", "Peak bytes/s used for MBU.", ("source",)
        ).labels(m, peaks.bytes_source).set(peaks.bytes_per_second)

    # ---- engine thread --------------------------------------------------------------------

    def observe_step(self, stats: StepStats) -> None:
        with self._lock:
            for phase, seconds, flops, num_bytes, num_tokens in (
                ("prefill", stats.prefill_seconds, stats.prefill_flops, stats.prefill_bytes,
                 stats.num_prefill_tokens),
                ("decode", stats.decode_seconds, stats.decode_flops, stats.decode_bytes,
                 stats.num_decode_tokens),
            ):  # fmt: skip
                self.busy_seconds[phase].inc(seconds)
                self.flops[phase].inc(flops)
                self.memory_bytes[phase].inc(num_bytes)
                self.computed_tokens[phase].inc(num_tokens)
                if num_tokens:
                    self.forward_passes[phase].inc(stats.num_forward_passes)
            self.step_duration.observe(stats.duration_s)
            self.live.observe_step(stats)
            batch = stats.num_prefill_chunks + stats.num_decode_requests
            if batch:
                self.batch_size.observe(batch)
            self.preemptions.inc(stats.num_preemptions)
            self.window_freed_blocks.inc(stats.num_window_freed_blocks)
            self.prefix_queries.inc(stats.prefix_cache_queried_tokens)
            self.prefix_hits.inc(stats.prefix_cache_hit_tokens)
            self._set_queue_state(stats.num_waiting, stats.num_running, stats.kv_cache_usage)

    def observe_event(self, event: TokenEvent) -> None:
        """Latencies as tokens are produced: inter-token gaps, and TTFT (with its SLO verdict)
        at the first token rather than when the request ends."""
        with self._lock:
            if event.produced_at is None or not event.new_token_ids:
                return
            if event.previous_token_at is not None:
                self.itl.observe(event.produced_at - event.previous_token_at)
            elif event.arrival_time is not None:
                ttft = event.produced_at - event.arrival_time
                self.ttft.observe(ttft)
                self.ttft_judged.inc()
                if ttft > self.slo.slo_ttft_seconds:
                    self.ttft_misses.inc()

    # ---- loop thread ----------------------------------------------------------------------

    def observe_delivered(self, tenant: str, num_tokens: int) -> None:
        """Output tokens that went into a response (counted live, so rates follow traffic)."""
        with self._lock:
            self.generation_tokens.inc(num_tokens)
            self.tenants.observe_delivered(tenant, num_tokens)
            self.live.observe_delivered(num_tokens)

    def observe_settlement(self, settlement: Settlement) -> None:
        """One finished API request: its bill and its choices' outcomes, booked once."""
        bill, m, tenant = settlement.bill, self.model_name, settlement.tenant
        with self._lock:
            self.prompt_tokens.inc(bill.prompt_tokens)
            self.cached_prompt_tokens.inc(bill.cached_tokens)
            self.undelivered_tokens.inc(bill.undelivered_tokens)
            self.request_cost.observe(bill.cost_usd)
            self.live.observe_settlement(bill)
            self.tenants.observe_settlement(tenant, bill, settlement.finish_reasons)
            for reason, event, delivered in zip(
                settlement.finish_reasons,
                settlement.final_events,
                settlement.delivered,
                strict=True,
            ):
                self.requests.labels(model=m, finished_reason=reason).inc()
                self._observe_outcome(reason, event, delivered)

    def _observe_outcome(self, reason: str, event: TokenEvent | None, delivered: int) -> None:
        times = event.times if event is not None else None
        if times is None:
            # The engine never reported back: it failed the request. One that had produced a
            # token was judged at that first token already.
            if delivered == 0:
                self.ttft_judged.inc()
                self.ttft_misses.inc()
            return
        if times.finished is not None:
            self.e2e.observe(times.finished - times.arrival)
        if times.first_scheduled is not None:
            self.queue_time.observe(times.first_scheduled - times.arrival)
        if times.first_token is None:
            waited = (times.finished or times.arrival) - times.arrival
            if reason in FAILED_REASONS or waited > self.slo.slo_ttft_seconds:
                self.ttft_judged.inc()
                self.ttft_misses.inc()
            return
        ttft = times.first_token - times.arrival
        tpot = _time_per_output_token(event)
        if tpot is not None:
            self.tpot.observe(tpot)
        met_ttft = ttft <= self.slo.slo_ttft_seconds
        met_tpot = tpot is None or tpot <= self.slo.slo_itl_seconds
        if reason in COMPLETED_REASONS and met_ttft and met_tpot:
            self.goodput.inc()

    def observe_rejection(self, reason: str) -> None:
        """reason must come from a fixed set (e.g. "queue_full", "draining")."""
        with self._lock:
            self.rejections.labels(model=self.model_name, reason=reason).inc()

    def set_queue_state(self, num_waiting: int, num_running: int, kv_cache_usage: float) -> None:
        with self._lock:
            self._set_queue_state(num_waiting, num_running, kv_cache_usage)

    def _set_queue_state(self, num_waiting: int, num_running: int, kv_cache_usage: float) -> None:
        self.num_waiting.set(num_waiting)
        self.num_running.set(num_running)
        self.kv_cache_usage.set(kv_cache_usage)
        self.live.observe_queue(num_waiting, num_running, kv_cache_usage)

    def render(self, *, include_tenants: bool = True) -> tuple[bytes, str]:
        """The exposition text and its content type (text format 0.0.4, which every Prometheus
        since 2.0 parses), for GET /metrics; without the per-tenant series when told."""
        with self._lock:
            body = generate_latest(self.registry)
            if include_tenants:
                body += generate_latest(self.tenant_registry)
            return body, CONTENT_TYPE_PLAIN_0_0_4


def _live_facts(
    meter: Meter, model: str, num_params: int, max_num_seqs: int | None, kv: KVCacheInfo
) -> LiveFacts:
    return LiveFacts(
        model=model,
        num_params=num_params,
        peak_flops_per_second=meter.peaks.flops_per_second,
        peak_memory_bandwidth_bytes_per_second=meter.peaks.bytes_per_second,
        hardware_price_per_second=meter.config.hardware_price_per_second,
        max_num_seqs=max_num_seqs,
        kv_cache_capacity_tokens=kv.max_tokens,
    )


def _time_per_output_token(event: TokenEvent) -> float | None:
    times = event.times
    if times is None or times.first_token is None or times.last_token is None:
        return None
    if event.num_output_tokens < 2:
        return None
    return (times.last_token - times.first_token) / (event.num_output_tokens - 1)
