"""ServerMetrics fed real StepStats, TokenEvents, deliveries and Settlements of real
RequestGroups; its exposition parsed back and checked against hand-computed values."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.meter.billing import Prices
from engine.meter.config import MeterConfig
from engine.meter.cost_model import CostModel, ModelShape, WeightBytes
from engine.meter.energy import EnergyMeter, rapl_zones
from engine.meter.meter import Meter
from engine.meter.peaks import Peaks
from engine.stats import KVCacheInfo, StepStats
from scheduler.output import TokenEvent
from scheduler.request import RequestCost, RequestTimes
from scheduler.sampling_params import SamplingParams
from server.engine_client.request_group import (
    FAILED,
    TIMED_OUT,
    BillingAccount,
    EngineRequestSpec,
    RequestGroup,
    Settlement,
)
from server.metering.prometheus_export import FINISHED_REASONS, ServerMetrics
from server.routes.metrics import router

MODEL = "smollm2"
CONFIG = MeterConfig(
    hardware_price_per_hour=3.6,  # one cent per 10 s: 0.001 $/s
    price_per_million_input_tokens=0.5,
    price_per_million_output_tokens=2.0,
    peak_flops=1e12,
    peak_memory_bandwidth=2e10,
    slo_ttft_seconds=0.5,
    slo_itl_seconds=0.1,
)
PRICE_PER_SECOND = CONFIG.hardware_price_per_second
SHAPE = ModelShape(
    num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
    vocab_size=10, num_params=1272, dtype_bytes=2, tie_word_embeddings=True,
)  # fmt: skip
# Distinct bytes per kernel path, so the gauge shows which is which.
WEIGHTS = WeightBytes(
    body_small=300.0, body_large=1000.0, head_small=50.0, head_large=200.0, embedding_row=16.0,
    small_batch_rows=4,
)  # fmt: skip
PEAKS = Peaks(1e12, 2e10, "configured", "configured")
KV = KVCacheInfo(block_size=16, num_blocks=64, bytes_per_block=4096)
TENANTS = ("acme", "default")


def _metrics(config: MeterConfig = CONFIG, peaks: Peaks = PEAKS, **kwargs) -> ServerMetrics:
    kwargs.setdefault("energy_meter", EnergyMeter([]))
    kwargs.setdefault("tenants", TENANTS)
    kwargs.setdefault("max_num_seqs", 8)
    meter = Meter(config, CostModel(SHAPE, WEIGHTS), peaks)
    return ServerMetrics(meter, MODEL, KV, SHAPE.num_params, **kwargs)


def _samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _value(samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model": MODEL, **labels}.items()))]


# ---- inputs, as the engine and the server produce them ------------------------------------

BASE_STEP = StepStats(
    started_at=100.0,
    duration_s=0.04,
    num_prefill_tokens=10,
    num_decode_tokens=2,
    num_prefill_chunks=1,
    num_decode_requests=2,
    num_running=3,
    num_waiting=4,
    kv_cache_usage=0.25,
    num_preemptions=1,
    num_window_freed_blocks=3,
    prefix_cache_queried_tokens=10,
    prefix_cache_hit_tokens=4,
    prefill_flops=3e9,
    decode_flops=1e9,
    prefill_bytes=5e6,
    decode_bytes=1e6,
    prefill_seconds=0.03,
    decode_seconds=0.01,
    num_forward_passes=1,
)


def _step(**overrides) -> StepStats:
    return replace(BASE_STEP, **overrides)


def _token(
    request_id: str, arrival: float, produced_at: float, previous: float | None = None
) -> TokenEvent:
    """A running request's token event, as scheduler.update() builds it."""
    return TokenEvent(
        request_id=request_id,
        new_token_ids=[11],
        produced_at=produced_at,
        previous_token_at=previous,
        arrival_time=arrival,
    )


def _final(
    request_id: str,
    reason: str,
    *,
    arrival: float = 10.0,
    first_scheduled: float | None = None,
    first_token: float | None = None,
    last_token: float | None = None,
    finished: float | None = None,
    num_prompt: int = 7,
    cached: int = 0,
    output: int = 0,
    cost: RequestCost | None = None,
) -> TokenEvent:
    """A finishing event: the request's timestamps and attributed cost."""
    times = RequestTimes(arrival, first_scheduled, first_token, last_token, finished)
    return TokenEvent(
        request_id=request_id,
        new_token_ids=[],
        finish_reason=reason,
        num_prompt_tokens=num_prompt,
        num_cached_tokens=cached,
        num_output_tokens=output,
        arrival_time=arrival,
        times=times,
        cost=cost if cost is not None else RequestCost(),
    )


def _group(
    prompt_lengths: list[int], n: int = 1, tenant: str = "default", prices: Prices | None = None
) -> RequestGroup:
    """Choice i belongs to prompt i // n, as the routes build it."""
    specs = [
        EngineRequestSpec(f"r{p}-{c}", list(range(length)), SamplingParams(), prompt_index=p)
        for p, length in enumerate(prompt_lengths)
        for c in range(n)
    ]
    account = BillingAccount(tenant, prices if prices is not None else CONFIG.default_prices)
    return RequestGroup(specs, None, account)


def _deliver(metrics: ServerMetrics, group: RequestGroup, index: int, num_tokens: int) -> None:
    """What EngineClient.deliver does when tokens go into the response."""
    group.delivered[index] += num_tokens
    metrics.observe_delivered(group.account.tenant, num_tokens)


def _end(group: RequestGroup, index: int, final: TokenEvent | None, reason: str | None) -> None:
    """A choice's end: the reason the client saw (None: unfinished at release, so it takes
    the group's end_reason) and the final event the dispatcher stored."""
    group.finish_reasons[index] = reason
    group.final_events[index] = final


def _settle(group: RequestGroup) -> Settlement:
    """What EngineClient._settle_if_complete does once the group is released."""
    group.released = True
    group.settled = True
    return group.settlement(PRICE_PER_SECOND)


def _one_choice(
    reason: str, end_reason: str | None = None, tenant: str = "default", **final
) -> Settlement:
    """A one-choice request whose final event has `final`'s fields. With end_reason given the
    choice was unfinished when the group ended (the final event is the abort's ack)."""
    group = _group([7], tenant=tenant)
    final_event = _final("r0-0", "abort" if end_reason else reason, **final)
    if end_reason is not None:
        group.end_reason = end_reason
        _end(group, 0, final_event, None)
    else:
        _end(group, 0, final_event, reason)
    return _settle(group)


# ---- the engine thread's feeds ------------------------------------------------------------


def test_step_stats_become_exact_counter_values():
    metrics = _metrics()
    metrics.observe_step(_step())
    metrics.observe_step(_step(num_prefill_tokens=0, num_prefill_chunks=0, prefill_flops=0.0,
                               prefill_bytes=0.0, prefill_seconds=0.0, decode_seconds=0.02,
                               num_preemptions=0, num_waiting=0, kv_cache_usage=0.5))  # fmt: skip
    s = _samples(metrics)
    assert _value(s, "meterserve_busy_seconds_total", phase="prefill") == pytest.approx(0.03)
    assert _value(s, "meterserve_busy_seconds_total", phase="decode") == pytest.approx(0.03)
    assert _value(s, "meterserve_flops_total", phase="prefill") == 3e9
    assert _value(s, "meterserve_flops_total", phase="decode") == 2e9
    assert _value(s, "meterserve_memory_bytes_total", phase="prefill") == 5e6
    assert _value(s, "meterserve_memory_bytes_total", phase="decode") == 2e6
    assert _value(s, "meterserve_computed_tokens_total", phase="prefill") == 10
    assert _value(s, "meterserve_computed_tokens_total", phase="decode") == 4
    # The first step had both phases, the second decode only.
    assert _value(s, "meterserve_forward_passes_total", phase="prefill") == 1
    assert _value(s, "meterserve_forward_passes_total", phase="decode") == 2
    assert _value(s, "meterserve_preemptions_total") == 1
    assert _value(s, "meterserve_window_freed_blocks_total") == 6
    assert _value(s, "meterserve_prefix_cache_queries_total") == 20
    assert _value(s, "meterserve_prefix_cache_hits_total") == 8
    assert _value(s, "meterserve_step_duration_seconds_count") == 2
    assert _value(s, "meterserve_step_duration_seconds_sum") == pytest.approx(0.08)
    assert _value(s, "meterserve_running_batch_size_bucket", le="2.0") == 1  # second step
    assert _value(s, "meterserve_running_batch_size_bucket", le="4.0") == 2
    # Queue gauges follow the latest step.
    assert _value(s, "meterserve_num_requests_waiting") == 0
    assert _value(s, "meterserve_num_requests_running") == 3
    assert _value(s, "meterserve_kv_cache_usage_ratio") == 0.5
    # Steps carry no requests' outcomes or tokens billed.
    assert _value(s, "meterserve_prompt_tokens_total") == 0
    assert _value(s, "meterserve_generation_tokens_total") == 0


def test_ttft_and_its_miss_are_counted_at_the_first_token():
    metrics = _metrics()  # TTFT SLO 0.5 s
    metrics.observe_event(_token("fast", arrival=10.0, produced_at=10.2))
    metrics.observe_event(_token("slow", arrival=20.0, produced_at=20.75))
    s = _samples(metrics)
    assert _value(s, "meterserve_time_to_first_token_seconds_count") == 2
    assert _value(s, "meterserve_time_to_first_token_seconds_sum") == pytest.approx(0.95)
    # The SLO is itself a bucket boundary, so "within SLO" is exact.
    assert _value(s, "meterserve_time_to_first_token_seconds_bucket", le="0.5") == 1
    assert _value(s, "meterserve_slo_ttft_requests_total") == 2
    assert _value(s, "meterserve_slo_ttft_misses_total") == 1
    # Neither request has ended: nothing is counted as finished yet.
    assert all(
        _value(s, "meterserve_requests_total", finished_reason=reason) == 0
        for reason in FINISHED_REASONS
    )
    assert _value(s, "meterserve_e2e_request_latency_seconds_count") == 0

    # Their settlements do not judge them again.
    for request_id, arrival, first in (("fast", 10.0, 10.2), ("slow", 20.0, 20.75)):
        metrics.observe_settlement(
            _one_choice("stop", arrival=arrival, first_token=first, last_token=first + 0.1,
                        finished=first + 0.1, output=2)
        )  # fmt: skip
    s = _samples(metrics)
    assert _value(s, "meterserve_time_to_first_token_seconds_count") == 2
    assert _value(s, "meterserve_slo_ttft_requests_total") == 2
    assert _value(s, "meterserve_slo_ttft_misses_total") == 1
    assert _value(s, "meterserve_requests_total", finished_reason="stop") == 2


def test_inter_token_latency_between_consecutive_tokens():
    metrics = _metrics()  # ITL SLO 0.1 s
    metrics.observe_event(_token("r1", 10.0, produced_at=10.2))  # first: TTFT, no gap
    metrics.observe_event(_token("r1", 10.0, produced_at=10.25, previous=10.2))
    metrics.observe_event(_token("r1", 10.0, produced_at=10.45, previous=10.25))
    # Events without a new token (an abort's acknowledgement) carry no latency.
    metrics.observe_event(TokenEvent("r1", new_token_ids=[], finish_reason="abort",
                                     arrival_time=10.0))  # fmt: skip
    metrics.observe_event(TokenEvent("r2", new_token_ids=[], produced_at=11.0, arrival_time=10.0))
    s = _samples(metrics)
    assert _value(s, "meterserve_inter_token_latency_seconds_count") == 2
    assert _value(s, "meterserve_inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert _value(s, "meterserve_inter_token_latency_seconds_bucket", le="0.1") == 1
    assert _value(s, "meterserve_inter_token_latency_seconds_bucket", le="0.2") == 2
    assert _value(s, "meterserve_time_to_first_token_seconds_count") == 1
    assert _value(s, "meterserve_slo_ttft_requests_total") == 1


# ---- the loop thread's feeds --------------------------------------------------------------


def test_delivered_tokens_are_counted_live_in_total_and_by_tenant():
    metrics = _metrics()
    metrics.observe_delivered("acme", 3)
    metrics.observe_delivered("default", 2)
    metrics.observe_delivered("acme", 4)
    s = _samples(metrics)
    assert _value(s, "meterserve_generation_tokens_total") == 9
    assert _value(s, "meterserve_tenant_generation_tokens_total", tenant="acme") == 7
    assert _value(s, "meterserve_tenant_generation_tokens_total", tenant="default") == 2


def test_a_settlement_books_its_bill_exactly():
    metrics = _metrics()
    # Two prompts (7 and 5 tokens), n=2, for tenant acme at 1 $/M in and 4 $/M out.
    group = _group([7, 5], n=2, tenant="acme", prices=Prices(1.0, 4.0))
    cost = RequestCost(prefill_seconds=0.25, decode_seconds=0.125, prefill_flops=2e9)
    # r0-0: a stop string matched after 3 of the 4 tokens computed.
    _deliver(metrics, group, 0, 3)
    _end(group, 0, _final("r0-0", "stop", cached=3, output=4, cost=cost), "stop")
    # r0-1: ran to max_tokens.
    _deliver(metrics, group, 1, 4)
    _end(group, 1, _final("r0-1", "length", cached=4, output=4, cost=cost), "length")
    # r1-0: stopped on EOS.
    _deliver(metrics, group, 2, 2)
    _end(group, 2, _final("r1-0", "stop", cached=0, output=2, cost=cost), "stop")
    # r1-1: still running when the client left; the abort's ack says 3 tokens were computed.
    _deliver(metrics, group, 3, 1)
    _end(group, 3, _final("r1-1", "abort", cached=1, output=3, cost=cost), None)
    settlement = _settle(group)
    bill = settlement.bill
    metrics.observe_settlement(settlement)
    s = _samples(metrics)

    assert (bill.prompt_tokens, bill.cached_tokens, bill.completion_tokens) == (12, 3, 10)
    assert _value(s, "meterserve_prompt_tokens_total") == 12  # each prompt once
    assert _value(s, "meterserve_cached_prompt_tokens_total") == 3  # min(3, 4) + min(0, 1)
    assert _value(s, "meterserve_undelivered_tokens_total") == 1 + 0 + 0 + 2
    assert _value(s, "meterserve_generation_tokens_total") == bill.completion_tokens
    # One request, one cost observation, the bill's own number.
    assert bill.cost_usd == pytest.approx(4 * 0.375 * 0.001)
    assert _value(s, "meterserve_request_cost_dollars_count") == 1
    assert _value(s, "meterserve_request_cost_dollars_sum") == bill.cost_usd
    # Choices by the reason their client got.
    assert _value(s, "meterserve_requests_total", finished_reason="stop") == 2
    assert _value(s, "meterserve_requests_total", finished_reason="length") == 1
    assert _value(s, "meterserve_requests_total", finished_reason="abort") == 1
    # The tenant's counters equal the bill.
    assert _value(s, "meterserve_tenant_prompt_tokens_total", tenant="acme") == 12
    assert _value(s, "meterserve_tenant_cached_prompt_tokens_total", tenant="acme") == 3
    assert _value(s, "meterserve_tenant_generation_tokens_total", tenant="acme") == 10
    assert _value(s, "meterserve_tenant_cost_dollars_total", tenant="acme") == bill.cost_usd
    assert _value(s, "meterserve_tenant_revenue_dollars_total", tenant="acme") == bill.revenue_usd
    assert bill.revenue_usd == pytest.approx((12 * 1.0 + 10 * 4.0) / 1e6)
    assert _value(s, "meterserve_tenant_requests_total", tenant="acme",
                  finished_reason="stop") == 2  # fmt: skip
    # Nothing lands on the other tenant.
    assert _value(s, "meterserve_tenant_prompt_tokens_total", tenant="default") == 0
    assert _value(s, "meterserve_tenant_cost_dollars_total", tenant="default") == 0


def test_requests_are_counted_per_choice_by_the_finish_reason_the_client_got():
    metrics = _metrics()
    done = {"first_token": 10.1, "last_token": 10.2, "finished": 10.2, "output": 2}
    metrics.observe_settlement(_one_choice("stop", tenant="acme", **done))
    metrics.observe_settlement(_one_choice("length", tenant="acme", **done))
    # The client left, the server timed the request out, the engine failed it.
    metrics.observe_settlement(_one_choice("abort", end_reason="abort", tenant="acme", **done))
    metrics.observe_settlement(_one_choice("timeout", end_reason=TIMED_OUT, tenant="acme", **done))
    failed = _group([7], n=2, tenant="acme")  # Generation._fail: one choice errs, both end
    _end(failed, 0, _final("r0-0", "error", **done), FAILED)
    failed.end_reason = FAILED
    _end(failed, 1, _final("r0-1", "abort", **done), None)
    metrics.observe_settlement(_settle(failed))
    s = _samples(metrics)
    expected = {"stop": 1, "length": 1, "abort": 1, "timeout": 1, "error": 2}
    for reason, count in expected.items():
        assert _value(s, "meterserve_requests_total", finished_reason=reason) == count
        assert (
            _value(s, "meterserve_tenant_requests_total", tenant="acme", finished_reason=reason)
            == count
        )
        assert (
            _value(s, "meterserve_tenant_requests_total", tenant="default", finished_reason=reason)
            == 0
        )


def test_latencies_of_a_finished_request():
    metrics = _metrics()  # ITL SLO 0.1 s
    group = _group([7], n=2)
    # Scheduled after 0.05 s, tokens at +0.2 and +0.45 (3 tokens): TPOT 0.125.
    _end(group, 0, _final("r0-0", "stop", first_scheduled=10.05, first_token=10.2,
                          last_token=10.45, finished=10.45, output=3), "stop")  # fmt: skip
    # Never scheduled: the client left after 0.3 s.
    _end(group, 1, _final("r0-1", "abort", finished=10.3), None)
    metrics.observe_settlement(_settle(group))
    s = _samples(metrics)
    assert _value(s, "meterserve_e2e_request_latency_seconds_count") == 2
    assert _value(s, "meterserve_e2e_request_latency_seconds_sum") == pytest.approx(0.75)
    assert _value(s, "meterserve_request_queue_time_seconds_count") == 1
    assert _value(s, "meterserve_request_queue_time_seconds_sum") == pytest.approx(0.05)
    assert _value(s, "meterserve_time_per_output_token_seconds_count") == 1
    assert _value(s, "meterserve_time_per_output_token_seconds_sum") == pytest.approx(0.125)
    assert _value(s, "meterserve_time_per_output_token_seconds_bucket", le="0.1") == 0
    # TTFT is observed at the first token event, never from a settlement.
    assert _value(s, "meterserve_time_to_first_token_seconds_count") == 0


@pytest.mark.parametrize(
    ("end_reason", "waited", "has_final_event", "missed"),
    [
        (TIMED_OUT, 0.1, True, True),  # the server timed it out: its fault however soon
        ("abort", 0.3, True, False),  # the client left before the SLO: tells nothing
        ("abort", 0.8, True, True),  # the client left after waiting past the SLO
        (FAILED, 0.1, True, True),  # the engine failed it
        (FAILED, 0.1, False, True),  # the engine never reported back
    ],
)
def test_a_choice_that_ended_without_a_first_token(end_reason, waited, has_final_event, missed):
    metrics = _metrics()  # TTFT SLO 0.5 s
    group = _group([7])
    group.end_reason = end_reason
    final = _final("r0-0", "abort", arrival=10.0, finished=10.0 + waited)
    _end(group, 0, final if has_final_event else None, None)
    metrics.observe_settlement(_settle(group))
    s = _samples(metrics)
    assert _value(s, "meterserve_slo_ttft_requests_total") == int(missed)
    assert _value(s, "meterserve_slo_ttft_misses_total") == int(missed)
    assert _value(s, "meterserve_time_to_first_token_seconds_count") == 0
    assert _value(s, "meterserve_requests_total", finished_reason=end_reason) == 1
    assert _value(s, "meterserve_goodput_requests_total") == 0


def test_a_choice_lost_after_its_first_token_is_judged_once():
    metrics = _metrics()  # TTFT SLO 0.5 s
    metrics.observe_event(_token("r0-0", arrival=10.0, produced_at=10.2))  # met the SLO
    group = _group([7])
    _deliver(metrics, group, 0, 1)
    group.end_reason = FAILED  # the engine thread died; no final event will come
    metrics.observe_settlement(_settle(group))
    s = _samples(metrics)
    assert _value(s, "meterserve_slo_ttft_requests_total") == 1
    assert _value(s, "meterserve_slo_ttft_misses_total") == 0


def test_goodput_counts_completed_requests_that_met_both_slos():
    metrics = _metrics()  # TTFT SLO 0.5 s, ITL SLO 0.1 s

    def settle(reason: str, first_token: float, last_token: float, output: int, **kwargs):
        metrics.observe_settlement(
            _one_choice(reason, arrival=0.0, first_token=first_token, last_token=last_token,
                        finished=last_token, output=output, **kwargs)
        )  # fmt: skip

    settle("stop", 0.2, 0.3, 3)  # TTFT 0.2, TPOT 0.05: goodput
    settle("length", 0.5, 0.6, 3)  # TTFT exactly at the SLO: goodput
    settle("stop", 0.3, 0.3, 1)  # one token, no TPOT: judged on TTFT alone: goodput
    settle("stop", 0.6, 0.7, 3)  # TTFT 0.6 > 0.5: not
    settle("stop", 0.2, 0.45, 3)  # TPOT 0.125 > 0.1: not
    settle("abort", 0.2, 0.3, 3, end_reason="abort")  # fast but the client left: not
    settle("timeout", 0.2, 0.3, 3, end_reason=TIMED_OUT)  # not
    s = _samples(metrics)
    assert _value(s, "meterserve_goodput_requests_total") == 3
    assert _value(s, "meterserve_time_per_output_token_seconds_bucket", le="0.1") == 5
    assert _value(s, "meterserve_time_per_output_token_seconds_count") == 6


# ---- constants, series and gauges ---------------------------------------------------------


def test_tenant_series_exist_at_zero_before_any_traffic():
    s = _samples(_metrics())
    for tenant in TENANTS:
        for name in (
            "meterserve_tenant_prompt_tokens_total",
            "meterserve_tenant_cached_prompt_tokens_total",
            "meterserve_tenant_generation_tokens_total",
            "meterserve_tenant_cost_dollars_total",
            "meterserve_tenant_revenue_dollars_total",
        ):
            assert _value(s, name, tenant=tenant) == 0
        for reason in FINISHED_REASONS:
            assert (
                _value(s, "meterserve_tenant_requests_total", tenant=tenant,
                       finished_reason=reason) == 0
            )  # fmt: skip
    tenants = {
        dict(labels).get("tenant") for name, labels in s if name.startswith("meterserve_tenant_")
    }
    assert tenants == set(TENANTS)


def test_model_weight_bytes_by_kernel_path():
    s = _samples(_metrics())
    assert _value(s, "meterserve_model_weight_bytes", path="small_batch") == 300 + 50
    assert _value(s, "meterserve_model_weight_bytes", path="large_batch") == 1000 + 200


def test_peaks_are_labelled_with_their_sources():
    s = _samples(_metrics(peaks=Peaks(3e11, 4e10, "measured", "configured")))
    assert _value(s, "meterserve_peak_flops_per_second", source="measured") == 3e11
    assert (
        _value(s, "meterserve_peak_memory_bandwidth_bytes_per_second", source="configured") == 4e10
    )


def test_constants_rejections_and_gateway_gauges():
    metrics = _metrics()
    metrics.observe_rejection("queue_full")
    metrics.observe_rejection("queue_full")
    metrics.observe_rejection("draining")
    metrics.set_queue_state(num_waiting=5, num_running=8, kv_cache_usage=0.75)
    s = _samples(metrics)
    assert _value(s, "meterserve_request_rejections_total", reason="queue_full") == 2
    assert _value(s, "meterserve_request_rejections_total", reason="draining") == 1
    assert _value(s, "meterserve_num_requests_waiting") == 5
    assert _value(s, "meterserve_num_requests_running") == 8
    assert _value(s, "meterserve_kv_cache_usage_ratio") == 0.75
    assert _value(s, "meterserve_cache_config_info", block_size="16", num_blocks="64") == 1
    assert _value(s, "meterserve_kv_cache_capacity_tokens") == 1024
    assert _value(s, "meterserve_max_num_seqs") == 8
    assert _value(s, "meterserve_model_parameters") == 1272
    assert _value(s, "meterserve_slo_ttft_seconds") == 0.5
    assert _value(s, "meterserve_slo_itl_seconds") == 0.1
    assert _value(s, "meterserve_hardware_price_dollars_per_second") == pytest.approx(0.001)
    assert _value(s, "meterserve_price_dollars_per_input_token") == pytest.approx(5e-7)
    assert _value(s, "meterserve_price_dollars_per_output_token") == pytest.approx(2e-6)
    assert _value(s, "meterserve_cost_ceiling_dollars_per_output_token") == pytest.approx(1e-6)
    assert _value(s, "meterserve_energy_available", source="none") == 0
    assert not any(name == "meterserve_energy_joules_total" for name, _ in s)


def test_no_max_num_seqs_gauge_without_a_cap():
    s = _samples(_metrics(max_num_seqs=None))
    assert not any(name == "meterserve_max_num_seqs" for name, _ in s)


def test_energy_is_exported_from_a_readable_counter(tmp_path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text("1000000\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    metrics = _metrics(energy_meter=EnergyMeter(rapl_zones(tmp_path)))
    (zone / "energy_uj").write_text("3500000\n")
    s = _samples(metrics)
    assert _value(s, "meterserve_energy_available", source="rapl") == 1
    assert _value(s, "meterserve_energy_joules_total") == pytest.approx(2.5)


def test_concurrent_observers_and_scrapes_lose_nothing():
    metrics = _metrics()
    first_token = _token("r0-0", arrival=0.0, produced_at=0.2)
    settlement = _one_choice("stop", tenant="acme", arrival=0.0, first_token=0.2,
                             last_token=0.3, finished=0.3, output=3)  # fmt: skip

    def observe():
        for _ in range(200):
            metrics.observe_step(_step())
            metrics.observe_event(first_token)
            metrics.observe_delivered("acme", 3)
            metrics.observe_settlement(settlement)

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        metrics.render()
        # A scraper that re-takes the lock back to back can starve the observers for minutes
        # on 2 cores; real scrapes come seconds apart.
        time.sleep(0.002)
    for thread in threads:
        thread.join()
    s = _samples(metrics)
    assert _value(s, "meterserve_requests_total", finished_reason="stop") == 800
    assert _value(s, "meterserve_tenant_requests_total", tenant="acme",
                  finished_reason="stop") == 800  # fmt: skip
    assert _value(s, "meterserve_generation_tokens_total") == 2400
    assert _value(s, "meterserve_tenant_generation_tokens_total", tenant="acme") == 2400
    assert _value(s, "meterserve_prompt_tokens_total") == 800 * 7
    assert _value(s, "meterserve_request_cost_dollars_count") == 800
    assert _value(s, "meterserve_time_to_first_token_seconds_count") == 800
    assert _value(s, "meterserve_flops_total", phase="prefill") == 800 * 3e9


def test_the_metrics_route_serves_the_exposition():
    app = FastAPI()
    app.include_router(router)
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 503  # no metrics until the model loads
        app.state.metrics = _metrics()
        app.state.metrics.observe_rejection("queue_full")
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'meterserve_request_rejections_total{model="smollm2",reason="queue_full"} 1.0' in (
        response.text
    )
