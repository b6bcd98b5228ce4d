"""Summary arithmetic on hand-built records, the /metrics parser and server deltas, SSE
parsing, the load schedules and the plot. No server, no locust."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadtest.plot import plot_run, token_times
from loadtest.prom import parse_metrics
from loadtest.records import RecordWriter, RequestRecord, read_records
from loadtest.report import Slo, format_table, summarize
from loadtest.schedule import PoissonArrivals, ramp_users
from loadtest.server_figures import server_figures
from loadtest.sse import StreamTiming
from loadtest.stats import Distribution, percentile


def stream(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10):
    e2e = ttft + sum(itl)
    return RequestRecord(
        started_at=start, endpoint="chat_stream", session=0, turn=0, status=200, error=None,
        e2e_s=e2e, ttft_s=ttft, tpot_s=sum(itl) / (tokens - 1), itl_s=itl,
        prompt_tokens=prompt, completion_tokens=tokens,
    )  # fmt: skip


def failure(start: float, status: int) -> RequestRecord:
    return RequestRecord(start, "completions", 1, 0, status, f"HTTP {status}: full", e2e_s=0.01)


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 10.0], 90) == 9.0
    d = Distribution.of([float(i) for i in range(1, 101)])
    assert (d.count, d.p50, d.p99) == (100, 50.5, pytest.approx(99.01))
    assert Distribution.of([]).p50 is None


def test_summary_counts_failures_by_status_and_goodput() -> None:
    records = [
        stream(100.0, 0.5, [0.1, 0.1, 0.1], 4),
        stream(100.5, 3.0, [0.1, 0.1, 0.1], 4),  # TTFT misses a 2 s SLO
        stream(101.0, 0.2, [0.5, 0.5], 3),  # TPOT misses 0.25 s
        failure(101.5, 429),
        failure(101.6, 429),
        failure(101.7, 503),
    ]
    s = summarize(records, Slo(ttft_s=2.0, tpot_s=0.25), None, {"host": "h"})
    assert s["requests"]["total"] == 6 and s["requests"]["succeeded"] == 3
    assert s["requests"]["failures_by_status"] == {"429": 2, "503": 1}
    assert s["tokens"] == {"prompt": 30, "completion": 11, "cached_prompt": 0}
    assert s["goodput"]["requests"] == 1
    assert s["latency_s"]["itl"]["count"] == 8
    assert s["latency_s"]["ttft"]["p50"] == 0.5
    assert s["window_s"] == pytest.approx(103.8 - 100.0)  # 2nd request ends at 100.5 + 3.3
    table = format_table(s)
    assert "429" in table and "3 failed" in table and "TTFT" in table


def test_non_streamed_requests_are_judged_by_their_whole_latency() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    plain = RequestRecord(0.0, "chat", 0, 0, 200, None, e2e_s=1.9, completion_tokens=10)
    assert slo.met(plain)  # 1.9 ≤ 1.0 + 0.1 × 9
    plain.e2e_s = 2.0
    assert not slo.met(plain)


def test_records_round_trip_through_jsonl(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path / "r.jsonl")
    records = [stream(1.0, 0.1, [0.01, 0.02], 3), failure(2.0, 429)]
    for r in records:
        writer.write(r)
    writer.close()
    assert read_records(tmp_path / "r.jsonl") == records


METRICS_BEFORE = """# HELP meterserve_prompt_tokens_total x
# TYPE meterserve_prompt_tokens_total counter
meterserve_prompt_tokens_total{model="m"} 100.0
meterserve_generation_tokens_total{model="m"} 50.0
meterserve_busy_seconds_total{model="m",phase="prefill"} 1.0
meterserve_busy_seconds_total{model="m",phase="decode"} 2.0
meterserve_requests_total{finished_reason="length",model="m"} 3.0
meterserve_hardware_price_dollars_per_second{model="m"} 0.001
meterserve_flops_total{model="m",phase="decode"} 0
meterserve_peak_flops_per_second{model="m",source="measured"} 1e+09
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace(" 100.0", " 1100.0")
    .replace('generation_tokens_total{model="m"} 50.0', 'generation_tokens_total{model="m"} 1050.0')
    .replace('phase="decode"} 2.0', 'phase="decode"} 6.0')
    .replace('finished_reason="length",model="m"} 3.0', 'finished_reason="length",model="m"} 13.0')
    .replace('flops_total{model="m",phase="decode"} 0', 'flops_total{model="m",phase="decode"} 1e9')
)


def test_server_figures_from_metrics_deltas() -> None:
    before = parse_metrics(METRICS_BEFORE, taken_at=0.0)
    after = parse_metrics(METRICS_AFTER, taken_at=10.0)
    assert before.total("meterserve_busy_seconds_total") == 3.0
    assert before.total("meterserve_busy_seconds_total", phase="decode") == 2.0
    f = server_figures(before, after)
    assert f is not None
    assert (f.prompt_tokens, f.generation_tokens) == (1000, 1000)
    assert f.busy_decode_s == 4.0 and f.busy_prefill_s == 0.0
    assert f.utilization == pytest.approx(0.4)
    assert f.cost_usage_usd == pytest.approx(0.004)  # 4 busy seconds × $0.001
    assert f.cost_allocation_usd == pytest.approx(0.010)  # 10 wall seconds
    assert f.cost_per_1m_tokens_usage == pytest.approx(0.004 / 2000 * 1e6)
    assert f.requests_by_reason == {"length": 10}
    assert f.mfu == pytest.approx(0.1)  # 1e9 FLOPs over 10 s / 1e9 peak
    assert server_figures(before, parse_metrics("other_metric 1\n")) is None


def test_stream_timing_reads_openai_sse() -> None:
    t = StreamTiming(sent_at=10.0)
    t.feed(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}', 10.1)
    t.feed(b"", 10.15)
    t.feed(b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}', 10.2)
    t.feed(": keep-alive comment", 10.25)
    t.feed('data: {"choices":[{"index":0,"text":"lo"}]}', 10.5)
    t.feed('data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}', 10.6)
    assert t.failure() is not None  # no [DONE] yet
    t.feed("data: [DONE]", 10.6)
    t.finish(10.7)
    assert t.failure() is None
    assert t.ttft == pytest.approx(0.2) and t.gaps == [pytest.approx(0.3)]
    assert t.tpot == pytest.approx((10.7 - 10.2) / 2) and t.e2e == pytest.approx(0.7)
    assert "".join(t.text) == "Hello" and t.completion_tokens == 3
    bad = StreamTiming(sent_at=0.0)
    bad.feed('data: {"error":{"message":"engine fault","type":"server_error"}}', 1.0)
    assert bad.failure() == "stream error: engine fault"


def test_ramp_and_poisson_schedules() -> None:
    assert [ramp_users(t, 4, 10.0, 10) for t in (0, 9.9, 10, 25, 100)] == [4, 4, 8, 10, 10]
    arrivals = PoissonArrivals(5.0, random.Random(0), start=0.0)
    now, gaps = 0.0, []
    for _ in range(20_000):  # a user that is never busy: arrivals land exactly on schedule
        wait = arrivals.delay(now)
        now += wait
        gaps.append(wait)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 5.0, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std == pytest.approx(mean, rel=0.05)
    busy = PoissonArrivals(5.0, random.Random(0), start=0.0)
    assert busy.delay(1000.0) == 0.0 and busy.num_late == 1  # late: send at once, count it


def test_plot_writes_a_png(tmp_path: Path) -> None:
    records = [stream(100.0 + i * 0.3, 0.2, [0.05] * 9, 10) for i in range(30)]
    records.append(failure(105.0, 429))
    assert sum(n for _, n in token_times(records[0])) == pytest.approx(10)
    plot_run(records, tmp_path / "plot.png", "test")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
