"""ServerMetrics: the engine's StepStats and TokenEvents as Prometheus metrics.

The only prometheus_client importer in the repository. Conventions: prefix `meterserve_`,
base units (seconds, bytes, joules, dollars), `_total` counters, `_ratio` for 0..1, and only
bounded labels: model, phase, finished_reason, reason (plus the fixed facts block_size,
num_blocks and source on info-style gauges). docs/metrics.md lists every metric.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.energy import EnergyMeter
from engine.peak import measure_peaks
from engine.stats import KVCacheInfo, StepStats
from scheduler.output import TokenEvent
from server.meter_config import MeterConfig

PREFIX = "meterserve_"
PHASES = ("prefill", "decode")
# Requests that ended normally; aborts and errors never count as goodput.
COMPLETED_REASONS = ("stop", "length")

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
    """Owns a registry of meterserve metrics and updates it from engine outputs.

    observe_* run on the engine thread and render() on the asyncio thread; one lock makes
    every scrape a consistent snapshot (no request counted in one metric but not another).
    """

    def __init__(
        self,
        meter: MeterConfig,
        model_name: str,
        kv_cache_info: KVCacheInfo,
        num_params: int,
        dtype_bytes: int,
        registry: CollectorRegistry | None = None,
        *,
        max_num_seqs: int | None = None,
        energy_meter: EnergyMeter | None = None,
    ) -> None:
        self.meter = meter
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._energy = energy_meter if energy_meter is not None else EnergyMeter.detect()
        self._define_traffic()
        self._define_queue(kv_cache_info, max_num_seqs)
        self._define_latency()
        self._define_cost()
        self._set_constants(num_params, dtype_bytes)
        self.registry.register(_EnergyCollector(self._energy, model_name))
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
            "requests", "Finished requests by OpenAI finish_reason.", ("finished_reason",)
        )
        for reason in (*COMPLETED_REASONS, "abort", "error"):
            self.requests.labels(model=m, finished_reason=reason)
        self.rejections = self._counter(
            "request_rejections", "Requests refused at admission, by reason.", ("reason",)
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of requests.").labels(m)
        self.cached_prompt_tokens = self._counter(
            "cached_prompt_tokens", "Prompt tokens served from the prefix cache."
        ).labels(m)
        self.generation_tokens = self._counter(
            "generation_tokens", "Tokens generated and returned to clients."
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
        self.prefix_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(m)

    def _define_latency(self) -> None:
        m, slo = self.model_name, self.meter
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Arrival to first token.",
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
        self.ttft_misses = self._counter(
            "slo_ttft_misses", "Requests whose time to first token exceeded the SLO."
        ).labels(m)

    def _define_cost(self) -> None:
        self.busy_seconds = self._by_phase(
            self._counter(
                "busy_seconds", "Engine step time, split by FLOPs share of the phase.", ("phase",)
            )
        )
        self.flops = self._by_phase(
            self._counter("flops", "Estimated floating-point operations.", ("phase",))
        )
        self.memory_bytes = self._by_phase(
            self._counter("memory_bytes", "Estimated bytes moved (weights, KV).", ("phase",))
        )
        self.request_cost = self._histogram(
            "request_cost_dollars", "Usage-basis hardware cost of one request.", COST_BUCKETS
        )

    def _set_constants(self, num_params: int, dtype_bytes: int) -> None:
        m, meter = self.model_name, self.meter
        gauges = {
            "model_parameters": ("Parameters of the served model.", num_params),
            "model_weight_bytes": ("Bytes of weights read per step.", num_params * dtype_bytes),
            "slo_ttft_seconds": ("Configured time-to-first-token SLO.", meter.slo_ttft_seconds),
            "slo_itl_seconds": ("Configured inter-token latency SLO.", meter.slo_itl_seconds),
            "hardware_price_dollars_per_second": (
                "Configured price of this replica's hardware.",
                meter.hardware_price_per_second,
            ),
            "price_dollars_per_input_token": (
                "List price charged per prompt token.",
                meter.price_per_million_input_tokens / 1e6,
            ),
            "price_dollars_per_output_token": (
                "List price charged per generated token.",
                meter.price_per_million_output_tokens / 1e6,
            ),
            "cost_ceiling_dollars_per_output_token": (
                "Alert threshold for the allocation-basis cost of a generated token.",
                meter.cost_ceiling_per_million_output_tokens / 1e6,
            ),
        }
        for name, (doc, value) in gauges.items():
            self._gauge(name, doc).labels(m).set(value)
        flops, bandwidth, flops_source, bandwidth_source = self._peaks(dtype_bytes)
        self._gauge("peak_flops_per_second", "Peak FLOP/s used for MFU.", ("source",)).labels(
            m, flops_source
        ).set(flops)
        self._gauge(
            "peak_memory_bandwidth_bytes_per_second", "Peak bytes/s used for MBU.", ("source",)
        ).labels(m, bandwidth_source).set(bandwidth)

    def _peaks(self, dtype_bytes: int) -> tuple[float, float, str, str]:
        flops, bandwidth = self.meter.peak_flops, self.meter.peak_memory_bandwidth
        if flops is not None and bandwidth is not None:
            return flops, bandwidth, "configured", "configured"
        dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
        device = "cuda" if torch.cuda.is_available() else "cpu"
        measured = measure_peaks(dtype, device)
        return (
            flops if flops is not None else measured.flops_per_second,
            bandwidth if bandwidth is not None else measured.bytes_per_second,
            "configured" if flops is not None else "measured",
            "configured" if bandwidth is not None else "measured",
        )

    # ---- updates --------------------------------------------------------------------------

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
            batch = stats.num_prefill_chunks + stats.num_decode_requests
            if batch:
                self.batch_size.observe(batch)
            self.preemptions.inc(stats.num_preemptions)
            self.prefix_queries.inc(stats.prefix_cache_queried_tokens)
            self.prefix_hits.inc(stats.prefix_cache_hit_tokens)
            self._set_queue_state(stats.num_waiting, stats.num_running, stats.kv_cache_usage)

    def observe_event(self, event: TokenEvent) -> None:
        with self._lock:
            if event.produced_at is not None and event.previous_token_at is not None:
                self.itl.observe(event.produced_at - event.previous_token_at)
            is_first_token = bool(event.new_token_ids) and event.previous_token_at is None
            # Prompt tokens count when the first token is out (the prompt has been computed),
            # or at the end of a request that never produced one.
            if is_first_token or (event.finished and event.num_output_tokens == 0):
                self.prompt_tokens.inc(event.num_prompt_tokens)
                self.cached_prompt_tokens.inc(event.num_cached_tokens)
            self.generation_tokens.inc(len(event.new_token_ids))
            if event.finish_reason is not None:
                self._observe_finished(event)

    def _observe_finished(self, event: TokenEvent) -> None:
        self.requests.labels(model=self.model_name, finished_reason=event.finish_reason).inc()
        if event.cost is not None:
            busy = event.cost.prefill_seconds + event.cost.decode_seconds
            self.request_cost.observe(busy * self.meter.hardware_price_per_second)
        times = event.times
        if times is None:
            return
        if times.finished is not None:
            self.e2e.observe(times.finished - times.arrival)
        if times.first_scheduled is not None:
            self.queue_time.observe(times.first_scheduled - times.arrival)
        if times.first_token is None:
            return
        ttft = times.first_token - times.arrival
        self.ttft.observe(ttft)
        if ttft > self.meter.slo_ttft_seconds:
            self.ttft_misses.inc()
        tpot = _time_per_output_token(event)
        if tpot is not None:
            self.tpot.observe(tpot)
        met_ttft = ttft <= self.meter.slo_ttft_seconds
        met_tpot = tpot is None or tpot <= self.meter.slo_itl_seconds
        if event.finish_reason in COMPLETED_REASONS and met_ttft and met_tpot:
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

    # ---- outputs --------------------------------------------------------------------------

    def usage_extension(self, event: TokenEvent) -> dict[str, float]:
        """This request's meter readings for the OpenAI `usage` object (finishing event only).

        Keys (docs/metrics.md): cost_usd, queue_seconds, time_to_first_token_seconds,
        prefill_seconds, decode_seconds, flops. A timing the request never reached is left out.
        """
        fields: dict[str, float] = {}
        if event.cost is not None:
            cost = event.cost
            busy = cost.prefill_seconds + cost.decode_seconds
            fields["cost_usd"] = busy * self.meter.hardware_price_per_second
            fields["prefill_seconds"] = cost.prefill_seconds
            fields["decode_seconds"] = cost.decode_seconds
            fields["flops"] = cost.prefill_flops + cost.decode_flops
        times = event.times
        if times is not None:
            scheduled = (
                times.first_scheduled if times.first_scheduled is not None else times.finished
            )
            if scheduled is not None:
                fields["queue_seconds"] = scheduled - times.arrival
            if times.first_token is not None:
                fields["time_to_first_token_seconds"] = times.first_token - times.arrival
        return fields

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type (text format 0.0.4, which every Prometheus
        since 2.0 parses), for GET /metrics."""
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


def _time_per_output_token(event: TokenEvent) -> float | None:
    times = event.times
    if times is None or times.first_token is None or times.last_token is None:
        return None
    if event.num_output_tokens < 2:
        return None
    return (times.last_token - times.first_token) / (event.num_output_tokens - 1)


class _EnergyCollector:
    """Reads the energy meter at scrape time; exports joules only when a source is readable."""

    def __init__(self, meter: EnergyMeter, model_name: str) -> None:
        self._meter = meter
        self._model_name = model_name

    def collect(self) -> Any:
        available = GaugeMetricFamily(
            PREFIX + "energy_available",
            "1 when an energy counter (RAPL or NVML) is readable, else 0.",
            labels=("model", "source"),
        )
        available.add_metric((self._model_name, self._meter.source), float(self._meter.available))
        yield available
        if not self._meter.available:
            return
        joules = self._meter.joules()
        if not math.isfinite(joules):
            return
        total = CounterMetricFamily(
            PREFIX + "energy_joules",
            "Energy consumed by the machine's CPU packages and GPUs since start-up.",
            labels=("model",),
        )
        total.add_metric((self._model_name,), joules)
        yield total
