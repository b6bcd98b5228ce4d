"""The Prometheus metric families meterserve exports, each defined once with its help text, labels and
buckets (docs/metrics.md lists them); server/metering/prometheus_export.py's ServerMetrics feeds
them.

Conventions: prefix `meterserve_`, base units (seconds, bytes, joules, dollars), `_total`
counters, `_ratio` for 0..1, and only bounded labels: model, phase, finished_reason, reason,
tenant (configured names, "default" or "other"), path (plus the fixed facts block_size,
num_blocks and source on info-style gauges). Two registries: `registry` holds the aggregate
series, `tenant_registry` the per-tenant ones (server/metering/tenant_metrics.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from engine.meter.energy import EnergyMeter
from engine.meter.meter import Meter
from engine.stats import KVCacheInfo
from server.metering.energy_collector import EnergyCollector
from server.metering.tenant_metrics import TenantMetrics

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


class MetricDefinitions:
    """Owns the registries and every metric family in them, with the constant gauges set
    (model, prices, SLOs, peaks, cache shape). Updating them is ServerMetrics' job."""

    def __init__(
        self,
        meter: Meter,
        model_name: str,
        kv_cache_info: KVCacheInfo,
        num_params: int,
        registry: CollectorRegistry | None,
        max_num_seqs: int | None,
        energy_meter: EnergyMeter | None,
        tenants: tuple[str, ...],
    ) -> None:
        self.meter = meter
        self.slo = meter.config
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenant_registry = CollectorRegistry()
        self._energy = energy_meter if energy_meter is not None else EnergyMeter.detect()
        self._define_traffic()
        self.tenants = TenantMetrics(self.tenant_registry, model_name, tenants, FINISHED_REASONS)
        self._define_queue(kv_cache_info, max_num_seqs)
        self._define_latency()
        self._define_cost()
        self._set_constants(num_params)
        self.registry.register(EnergyCollector(self._energy, model_name))
        ProcessCollector(registry=self.registry)

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
        self.spec_drafts = self._counter(
            "spec_decode_num_drafts", "Decodes that carried draft tokens (speculative decoding)."
        ).labels(m)
        self.spec_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified by the model."
        ).labels(m)
        self.spec_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens the model agreed with (emitted as output tokens).",
        ).labels(m)
        self.spec_backoffs = self._counter(
            "spec_decode_backoffs",
            "Decodes whose drafts were all rejected, pausing their request's drafting.",
        ).labels(m)
        self.spec_draft_model_passes = self._counter(
            "spec_decode_draft_model_passes",
            "Forward passes of the draft model (speculative method draft_model).",
        ).labels(m)
        self.spec_draft_model_seconds = self._counter(
            "spec_decode_draft_model_seconds",
            "Seconds of steps spent in the draft model's passes (part of the steps' time).",
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
        weight_bytes.labels(m, "small_batch").set(weights.small_total)
        weight_bytes.labels(m, "large_batch").set(weights.large_total)
        peaks = self.meter.peaks
        self._gauge("peak_flops_per_second", "Peak FLOP/s used for MFU.", ("source",)).labels(
            m, peaks.flops_source
        ).set(peaks.flops_per_second)
        self._gauge(
            "peak_memory_bandwidth_bytes_per_second", "Peak bytes/s used for MBU.", ("source",)
        ).labels(m, peaks.bytes_source).set(peaks.bytes_per_second)
