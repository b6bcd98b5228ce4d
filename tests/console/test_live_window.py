"""LiveWindow on a fake clock: one-second buckets, the one-minute totals computed by hand
(MFU, MBU, tokens/s, cost per 1M tokens as the recording rules define them), the queue
state carried over idle seconds, and old seconds dropped."""

from __future__ import annotations

import threading

import pytest

from engine.meter.billing import Bill
from engine.stats import StepStats
from server.metering.live_window import WINDOW_SECONDS, LiveFacts, LiveWindow

FACTS = LiveFacts(
    model="m",
    num_params=1000,
    peak_flops_per_second=1e9,
    peak_memory_bandwidth_bytes_per_second=1e8,
    hardware_price_per_second=0.01,
    max_num_seqs=8,
    kv_cache_capacity_tokens=4096,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stats(
    prefill_tokens: int = 0,
    decode_tokens: int = 0,
    chunks: int = 1,
    flops: float = 0.0,
    nbytes: float = 0.0,
    prefill_s: float = 0.0,
    decode_s: float = 0.0,
) -> StepStats:
    return StepStats(
        started_at=0.0,
        duration_s=prefill_s + decode_s,
        num_prefill_tokens=prefill_tokens,
        num_decode_tokens=decode_tokens,
        num_prefill_chunks=chunks if prefill_tokens else 0,
        num_decode_requests=decode_tokens,
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.1,
        num_preemptions=0,
        prefix_cache_queried_tokens=0,
        prefix_cache_hit_tokens=0,
        prefill_flops=flops,
        decode_flops=0.0,
        prefill_bytes=nbytes,
        decode_bytes=0.0,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        num_forward_passes=1,
    )


def bill(prompt_tokens: int) -> Bill:
    return Bill(prompt_tokens, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_an_empty_window_reports_zeros_and_nothing_to_divide():
    clock = Clock()
    live = LiveWindow(FACTS, clock)
    clock.now += 5
    view = live.snapshot()
    assert view["window_seconds"] == 5
    assert view["model_parameters"] == 1000
    assert view["now"] == {
        "num_running": 0,
        "num_waiting": 0,
        "kv_cache_usage": 0.0,
        "max_num_seqs": 8,
        "kv_cache_capacity_tokens": 4096,
    }
    minute = view["last_minute"]
    assert minute["steps"] == 0 and minute["mfu"] == 0.0 and minute["mbu"] == 0.0
    assert minute["mean_batch_size"] is None
    assert minute["cost_usd_per_million_input_tokens"] is None
    assert minute["cost_usd_per_million_output_tokens"] is None
    series = view["series"]
    assert len(series["num_running"]) == WINDOW_SECONDS
    assert series["seconds_ago"][0] == WINDOW_SECONDS and series["seconds_ago"][-1] == 1


def test_totals_over_the_window_by_hand():
    clock = Clock()
    live = LiveWindow(FACTS, clock)
    clock.now = 1010.2
    live.observe_step(stats(prefill_tokens=100, chunks=2, flops=4e9, nbytes=2e8, prefill_s=0.5))
    live.observe_settlement(bill(prompt_tokens=100))
    clock.now = 1011.7
    live.observe_step(stats(decode_tokens=3, flops=1e9, nbytes=1e8, decode_s=0.25))
    live.observe_delivered(3)
    clock.now = 1012.0  # both seconds are whole now
    view = live.snapshot()
    minute = view["last_minute"]
    span = 12  # seconds since the window started (fewer than a minute)
    assert view["window_seconds"] == span
    assert minute["steps"] == 2
    assert minute["mean_batch_size"] == pytest.approx((2 + 3) / 2)
    assert minute["max_batch_size"] == 3
    assert minute["mfu"] == pytest.approx(5e9 / (span * 1e9))
    assert minute["mbu"] == pytest.approx(3e8 / (span * 1e8))
    assert minute["busy_ratio"] == pytest.approx(0.75 / span)
    assert minute["prompt_tokens_computed_per_second"] == pytest.approx(100 / span)
    assert minute["generation_tokens_per_second"] == pytest.approx(3 / span)
    assert minute["cost_usd_per_million_input_tokens"] == pytest.approx(1e6 * 0.01 * 0.5 / 100)
    assert minute["cost_usd_per_million_output_tokens"] == pytest.approx(1e6 * 0.01 * 0.25 / 3)
    series = view["series"]
    assert series["mfu"][-2:] == [pytest.approx(4.0), pytest.approx(1.0)]  # 4e9, 1e9 in 1 s
    assert series["max_batch_size"][-2:] == [2, 3]
    assert series["generation_tokens_per_second"][-2:] == [0, 3]


def test_the_current_second_is_not_in_the_series_until_it_is_whole():
    clock = Clock()
    live = LiveWindow(FACTS, clock)
    clock.now = 1030.5
    live.observe_step(stats(decode_tokens=1, flops=1e9))
    assert live.snapshot()["series"]["mfu"][-1] == 0.0
    clock.now = 1031.0
    assert live.snapshot()["series"]["mfu"][-1] == pytest.approx(1.0)


def test_queue_state_peaks_per_second_and_carries_over_idle_seconds():
    clock = Clock()
    live = LiveWindow(FACTS, clock)
    clock.now = 1100.1
    live.observe_queue(num_waiting=1, num_running=2, kv_cache_usage=0.5)
    clock.now = 1100.6
    live.observe_queue(num_waiting=0, num_running=1, kv_cache_usage=0.25)
    clock.now = 1104.0
    view = live.snapshot()
    assert view["now"]["num_running"] == 1 and view["now"]["num_waiting"] == 0
    series = view["series"]
    # second 1100: the peak (2 running, 1 waiting); 1101-1103: the last reading (1, 0).
    assert series["num_running"][-4:] == [2, 1, 1, 1]
    assert series["num_waiting"][-4:] == [1, 0, 0, 0]
    assert series["kv_cache_usage"][-4:] == [0.5, 0.25, 0.25, 0.25]
    assert series["num_running"][-5] == 0  # before any reading: an empty queue


def test_seconds_older_than_the_window_are_dropped_but_their_state_carries():
    clock = Clock()
    live = LiveWindow(FACTS, clock)
    clock.now = 1200.5
    live.observe_step(stats(decode_tokens=1, flops=1e9))
    live.observe_queue(num_waiting=0, num_running=3, kv_cache_usage=0.1)
    clock.now = 1200.5 + 3 * WINDOW_SECONDS
    for _ in range(3):
        live.observe_delivered(1)  # a new bucket prunes the old ones
    view = live.snapshot()
    assert view["last_minute"]["steps"] == 0
    assert view["window_seconds"] == WINDOW_SECONDS
    assert view["series"]["num_running"] == [3] * WINDOW_SECONDS
    assert len(live._buckets) <= WINDOW_SECONDS + 2


def test_feeds_from_two_threads_lose_nothing():
    clock = Clock()
    live = LiveWindow(FACTS, clock)

    def deliver() -> None:
        for _ in range(2000):
            live.observe_delivered(1)

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    clock.now += 1
    assert sum(live.snapshot()["series"]["generation_tokens_per_second"]) == 8000
