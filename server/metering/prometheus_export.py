"""ServerMetrics: the meter's readings as Prometheus metrics. It exports; it computes nothing
that clients are told (costs and bills come from engine/meter).

With server/metering/metric_definitions.py (the families, their labels and buckets), the only
prometheus_client importers in the repository. docs/metrics.md lists every metric.

Two registries: `registry` holds the aggregate series, `tenant_registry` the per-tenant ones
(server/metering/tenant_metrics.py: who is billed what), so /metrics can render the aggregates alone
for a scrape that may not see other tenants' bills (server/routes/metrics.py).

Three feeds, each under one lock so a scrape is a consistent snapshot:
- observe_step / observe_event (engine thread): work done, latencies at the moment tokens
  are produced (TTFT at the first token);
- observe_delivered (loop thread): output tokens as they go into responses;
- observe_settlement (loop thread): one finished API request's bill, exactly once.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest

from engine.meter.energy import EnergyMeter
from engine.meter.meter import Meter
from engine.stats import KVCacheInfo, StepStats
from scheduler.output import TokenEvent
from server.engine_client.request_group import Settlement
from server.metering.live_window import LiveFacts, LiveWindow
from server.metering.metric_definitions import (
    COMPLETED_REASONS,
    FAILED_REASONS,
    FINISHED_REASONS,
    MetricDefinitions,
)

__all__ = ["FINISHED_REASONS", "ServerMetrics"]


class ServerMetrics(MetricDefinitions):
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
        super().__init__(
            meter,
            model_name,
            kv_cache_info,
            num_params,
            registry,
            max_num_seqs,
            energy_meter,
            tenants,
        )
        self._lock = threading.Lock()
        self.live = LiveWindow(
            _live_facts(meter, model_name, num_params, max_num_seqs, kv_cache_info)
        )

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
            self.spec_drafts.inc(stats.num_drafting_requests)
            self.spec_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_accepted_tokens.inc(stats.num_accepted_draft_tokens)
            self.spec_backoffs.inc(stats.num_draft_backoffs)
            self.spec_draft_model_passes.inc(stats.num_draft_model_passes)
            self.spec_draft_model_seconds.inc(stats.draft_model_seconds)
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
                # Tokens of one step (accepted drafts) arrive together: 0 s between them.
                for _ in event.new_token_ids[1:]:
                    self.itl.observe(0.0)
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
