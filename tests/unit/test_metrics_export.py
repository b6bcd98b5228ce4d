"""ServerMetrics fed real StepStats and TokenEvents; its exposition parsed back and checked."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from functools import partial

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.meter.energy import EnergyMeter, rapl_zones
from engine.stats import KVCacheInfo, StepStats
from scheduler.output import TokenEvent
from scheduler.request import RequestCost, RequestTimes
from engine.meter.config import MeterConfig
from server.metrics import ServerMetrics
from server.routes.metrics import router

MODEL = "smollm2"
METER = MeterConfig(
    hardware_price_per_hour=3.6,  # one cent per 10 s: 0.001 $/s
    price_per_million_input_tokens=0.5,
    price_per_million_output_tokens=2.0,
    peak_flops=1e12,
    peak_memory_bandwidth=2e10,
    slo_ttft_seconds=0.5,
    slo_itl_seconds=0.1,
)
KV = KVCacheInfo(block_size=16, num_blocks=64, bytes_per_block=4096)


def _metrics(**kwargs) -> ServerMetrics:
    kwargs.setdefault("energy_meter", EnergyMeter([]))
    return ServerMetrics(METER, MODEL, KV, 1000, 2, max_num_seqs=8, **kwargs)


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


def _request_events(arrival: float, reason: str = "stop") -> list[TokenEvent]:
    """A 7-token prompt (3 cached) answered with 3 tokens at t+0.2, +0.25, +0.45."""
    event = partial(TokenEvent, request_id="r1", num_prompt_tokens=7, num_cached_tokens=3)
    first = event(new_token_ids=[11], num_output_tokens=1, produced_at=arrival + 0.2)
    second = event(
        new_token_ids=[12],
        num_output_tokens=2,
        produced_at=arrival + 0.25,
        previous_token_at=arrival + 0.2,
    )
    times = RequestTimes(
        arrival=arrival,
        first_scheduled=arrival + 0.05,
        first_token=arrival + 0.2,
        last_token=arrival + 0.45,
        finished=arrival + 0.45,
    )
    cost = RequestCost(
        prefill_flops=2e9,
        decode_flops=1e9,
        prefill_seconds=0.02,
        decode_seconds=0.03,
        prefill_bytes=1e6,
        decode_bytes=2e6,
    )
    last = event(
        new_token_ids=[13],
        num_output_tokens=3,
        produced_at=arrival + 0.45,
        previous_token_at=arrival + 0.25,
        finish_reason=reason,
        times=times,
        cost=cost,
    )
    return [first, second, last]


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


def test_token_events_become_exact_request_metrics():
    metrics = _metrics()
    for event in _request_events(arrival=10.0):
        metrics.observe_event(event)
    s = _samples(metrics)
    assert _value(s, "meterserve_requests_total", finished_reason="stop") == 1
    assert _value(s, "meterserve_requests_total", finished_reason="abort") == 0
    assert _value(s, "meterserve_prompt_tokens_total") == 7
    assert _value(s, "meterserve_cached_prompt_tokens_total") == 3
    assert _value(s, "meterserve_generation_tokens_total") == 3
    # ITL observed twice: 0.05 and 0.2.
    assert _value(s, "meterserve_inter_token_latency_seconds_count") == 2
    assert _value(s, "meterserve_inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert _value(s, "meterserve_inter_token_latency_seconds_bucket", le="0.1") == 1
    assert _value(s, "meterserve_time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert _value(s, "meterserve_e2e_request_latency_seconds_sum") == pytest.approx(0.45)
    assert _value(s, "meterserve_request_queue_time_seconds_sum") == pytest.approx(0.05)
    # TPOT = (0.45 - 0.2) / 2 = 0.125 > SLO 0.1: not goodput, though TTFT 0.2 met its SLO.
    assert _value(s, "meterserve_time_per_output_token_seconds_sum") == pytest.approx(0.125)
    assert _value(s, "meterserve_goodput_requests_total") == 0
    assert _value(s, "meterserve_slo_ttft_misses_total") == 0
    # Cost: (0.02 + 0.03) busy seconds * 0.001 $/s.
    assert _value(s, "meterserve_request_cost_dollars_sum") == pytest.approx(5e-5)
    assert _value(s, "meterserve_request_cost_dollars_count") == 1


def test_goodput_and_ttft_misses_follow_the_slos():
    metrics = ServerMetrics(
        MeterConfig(peak_flops=1.0, peak_memory_bandwidth=1.0, slo_ttft_seconds=0.1,
                    slo_itl_seconds=0.2),
        MODEL, KV, 1000, 2, energy_meter=EnergyMeter([]),
    )  # fmt: skip
    for event in _request_events(arrival=0.0):  # TTFT 0.2 > 0.1, TPOT 0.125 <= 0.2
        metrics.observe_event(event)
    s = _samples(metrics)
    assert _value(s, "meterserve_slo_ttft_misses_total") == 1
    assert _value(s, "meterserve_goodput_requests_total") == 0
    # The SLO is itself a bucket boundary, so "within SLO" is exact.
    assert _value(s, "meterserve_time_to_first_token_seconds_bucket", le="0.1") == 0
    assert _value(s, "meterserve_time_per_output_token_seconds_bucket", le="0.2") == 1


def test_a_request_that_ends_without_tokens_still_counts_its_prompt():
    metrics = _metrics()
    times = RequestTimes(arrival=1.0, finished=1.5)
    event = TokenEvent(
        request_id="r2",
        new_token_ids=[],
        finish_reason="abort",
        num_prompt_tokens=9,
        times=times,
        cost=RequestCost(),
    )
    metrics.observe_event(event)
    s = _samples(metrics)
    assert _value(s, "meterserve_requests_total", finished_reason="abort") == 1
    assert _value(s, "meterserve_prompt_tokens_total") == 9
    assert _value(s, "meterserve_generation_tokens_total") == 0
    assert _value(s, "meterserve_time_to_first_token_seconds_count") == 0
    assert _value(s, "meterserve_e2e_request_latency_seconds_sum") == pytest.approx(0.5)
    assert metrics.usage_extension(event) == {
        "cost_usd": 0.0,
        "prefill_seconds": 0.0,
        "decode_seconds": 0.0,
        "flops": 0.0,
        "queue_seconds": 0.5,  # never scheduled: waited until it ended
    }


def test_usage_extension_of_the_finishing_event():
    metrics = _metrics()
    *running, last = _request_events(arrival=10.0)
    assert all(metrics.usage_extension(event) == {} for event in running)
    usage = metrics.usage_extension(last)
    assert usage == {
        "cost_usd": pytest.approx(5e-5),
        "prefill_seconds": 0.02,
        "decode_seconds": 0.03,
        "flops": 3e9,
        "queue_seconds": pytest.approx(0.05),
        "time_to_first_token_seconds": pytest.approx(0.2),
    }


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
    assert _value(s, "meterserve_hardware_price_dollars_per_second") == pytest.approx(0.001)
    assert _value(s, "meterserve_price_dollars_per_input_token") == pytest.approx(5e-7)
    assert _value(s, "meterserve_price_dollars_per_output_token") == pytest.approx(2e-6)
    assert _value(s, "meterserve_peak_flops_per_second", source="configured") == 1e12
    assert (
        _value(s, "meterserve_peak_memory_bandwidth_bytes_per_second", source="configured") == 2e10
    )
    assert _value(s, "meterserve_model_weight_bytes") == 2000
    assert _value(s, "meterserve_energy_available", source="none") == 0
    assert not any(name == "meterserve_energy_joules_total" for name, _ in s)


def test_unset_peaks_are_measured_and_labelled_so():
    metrics = ServerMetrics(
        MeterConfig(peak_memory_bandwidth=3e10), MODEL, KV, 1000, 4, energy_meter=EnergyMeter([])
    )
    s = _samples(metrics)
    flops = _value(s, "meterserve_peak_flops_per_second", source="measured")
    assert 1e8 < flops < 1e16 and math.isfinite(flops)
    assert (
        _value(s, "meterserve_peak_memory_bandwidth_bytes_per_second", source="configured") == 3e10
    )


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
    events = _request_events(arrival=0.0)

    def observe():
        for _ in range(200):
            metrics.observe_step(_step())
            for event in events:
                metrics.observe_event(event)

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
    assert _value(s, "meterserve_generation_tokens_total") == 2400
    assert _value(s, "meterserve_flops_total", phase="prefill") == 800 * 3e9


def test_the_metrics_route_serves_the_exposition():
    app = FastAPI()
    app.include_router(router)
    app.state.metrics = _metrics()
    app.state.metrics.observe_rejection("queue_full")
    with TestClient(app) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'meterserve_request_rejections_total{model="smollm2",reason="queue_full"} 1.0' in (
        response.text
    )
