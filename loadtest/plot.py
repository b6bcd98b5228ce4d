"""A PNG of one run over time: throughput (output tokens/s, requests/s, failures/s) on top,
latency (TTFT and e2e p50/p90 per time bucket) below. matplotlib with the Agg backend, so no
display is needed. No locust import.
"""

from __future__ import annotations

import math
from pathlib import Path

from loadtest.records import RequestRecord
from loadtest.stats import percentile


def token_times(r: RequestRecord) -> list[tuple[float, float]]:
    """(unix time, tokens) credits of one successful request: a stream's tokens are spread
    over its content chunks (chunk times rebuilt from TTFT + ITL gaps); a plain response's
    arrive at its end."""
    if not r.ok or r.e2e_s is None or not r.completion_tokens:
        return []
    if r.ttft_s is None:
        return [(r.started_at + r.e2e_s, float(r.completion_tokens))]
    times = [r.started_at + r.ttft_s]
    for gap in r.itl_s:
        times.append(times[-1] + gap)
    share = r.completion_tokens / len(times)
    return [(t, share) for t in times]


def plot_run(records: list[RequestRecord], path: Path, title: str, bucket_s: float = 1.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    if records:
        t0 = min(r.started_at for r in records)
        _plot_throughput(top, records, t0, bucket_s)
        _plot_latency(bottom, records, t0, max(5.0, bucket_s))
    top.set_title(title)
    top.set_ylabel("output tokens per second")
    bottom.set_ylabel("latency (s)")
    bottom.set_xlabel("seconds since the first request")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_throughput(ax, records: list[RequestRecord], t0: float, bucket_s: float) -> None:
    end = max(r.started_at + (r.e2e_s or 0.0) for r in records)
    n = max(1, math.ceil((end - t0) / bucket_s))
    tokens, done, failed = [0.0] * n, [0.0] * n, [0.0] * n

    def slot(t: float) -> int:
        return min(n - 1, max(0, int((t - t0) / bucket_s)))

    for r in records:
        for t, share in token_times(r):
            tokens[slot(t)] += share / bucket_s
        target = done if r.ok else failed
        target[slot(r.started_at + (r.e2e_s or 0.0))] += 1 / bucket_s
    xs = [(i + 0.5) * bucket_s for i in range(n)]
    ax.plot(xs, tokens, label="output tokens/s", color="tab:blue")
    requests_ax = ax.twinx()  # requests/s are two orders of magnitude below tokens/s
    requests_ax.plot(xs, done, label="requests done/s", color="tab:green")
    if any(failed):
        requests_ax.plot(xs, failed, label="failures/s", color="tab:red")
    requests_ax.set_ylabel("requests per second")
    requests_ax.legend(loc="upper right", fontsize=8)


def _plot_latency(ax, records: list[RequestRecord], t0: float, bucket_s: float) -> None:
    for name, get in (("TTFT", lambda r: r.ttft_s), ("e2e", lambda r: r.e2e_s)):
        buckets: dict[int, list[float]] = {}
        for r in records:
            value = get(r)
            if r.ok and value is not None:
                buckets.setdefault(int((r.started_at - t0) / bucket_s), []).append(value)
        keys = sorted(buckets)
        if not keys:
            continue
        xs = [(k + 0.5) * bucket_s for k in keys]
        for q, style in ((50, "-"), (90, "--")):
            ys = [percentile(sorted(buckets[k]), q) for k in keys]
            ax.plot(xs, ys, style, label=f"{name} p{q} (by request start)")
