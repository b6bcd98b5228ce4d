"""LiveWindow: the engine's last minute, for the console's live view (GET /v1/meterserve/live).

Plain Python (no Prometheus): ServerMetrics feeds it the same readings it exports, and the
snapshot is computed here from one-second buckets, so the console needs no Prometheus server.

    seconds:  [now_s - 60 .......................... now_s - 1] [now_s]
               the window: 60 whole seconds, oldest first         being filled, not shown

Each bucket holds what the steps finished in that second did (StepStats), the output tokens
delivered and the API requests settled in it, and the queue state seen in it (its peak is
charted; its last reading carries over the seconds an idle engine reports nothing). Figures
follow the recording rules (deploy/prometheus/rules/recording.yml), over the window:
  MFU  = FLOPs / (window seconds * peak FLOP/s)     MBU = bytes / (window seconds * peak B/s)
  cost per 1M input tokens  = 1e6 * price/s * busy prefill seconds / billed prompt tokens
  cost per 1M output tokens = 1e6 * price/s * busy decode seconds  / delivered output tokens
A figure with nothing to divide by is None (JSON null), not 0.

Thread-safe: observe_step / observe_queue run on the engine thread, observe_delivered /
observe_settlement / snapshot on the asyncio loop; one lock guards the buckets.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.meter.billing import Bill
from engine.stats import StepStats

WINDOW_SECONDS = 60


@dataclass(frozen=True, slots=True)
class LiveFacts:
    """What does not change while the server runs: the model, the peaks and the price."""

    model: str
    num_params: int
    peak_flops_per_second: float
    peak_memory_bandwidth_bytes_per_second: float
    hardware_price_per_second: float
    max_num_seqs: int | None
    kv_cache_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class _QueueState:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass(slots=True)
class _Bucket:
    """One second of readings (every count is what finished in that second)."""

    second: int
    steps: int = 0
    forward_passes: int = 0
    batch_size_sum: int = 0  # Σ requests per step
    batch_size_max: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    delivered_tokens: int = 0
    billed_prompt_tokens: int = 0
    settled_requests: int = 0
    peak: _QueueState | None = None  # the largest running, waiting and KV use seen
    last: _QueueState | None = None  # the last queue state seen in the second


class LiveWindow:
    """Owns the last WINDOW_SECONDS + 1 one-second buckets and the current queue state."""

    def __init__(self, facts: LiveFacts, clock: Callable[[], float] = time.monotonic) -> None:
        self.facts = facts
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[_Bucket] = deque()  # ascending `second`, at most the window + 1
        self._started = int(clock())
        self._queue = _QueueState()  # the latest reading

    # ---- feeds --------------------------------------------------------------------------

    def observe_step(self, stats: StepStats) -> None:
        batch = stats.num_prefill_chunks + stats.num_decode_requests
        with self._lock:
            bucket = self._bucket()
            bucket.steps += 1
            bucket.forward_passes += stats.num_forward_passes
            bucket.batch_size_sum += batch
            bucket.batch_size_max = max(bucket.batch_size_max, batch)
            bucket.prefill_tokens += stats.num_prefill_tokens
            bucket.decode_tokens += stats.num_decode_tokens
            bucket.prefill_seconds += stats.prefill_seconds
            bucket.decode_seconds += stats.decode_seconds
            bucket.flops += stats.prefill_flops + stats.decode_flops
            bucket.bytes += stats.prefill_bytes + stats.decode_bytes

    def observe_queue(self, num_waiting: int, num_running: int, kv_cache_usage: float) -> None:
        state = _QueueState(num_running, num_waiting, kv_cache_usage)
        with self._lock:
            self._queue = state
            bucket = self._bucket()
            peak = bucket.peak or state
            bucket.peak = _QueueState(
                max(peak.num_running, num_running),
                max(peak.num_waiting, num_waiting),
                max(peak.kv_cache_usage, kv_cache_usage),
            )
            bucket.last = state

    def observe_delivered(self, num_tokens: int) -> None:
        with self._lock:
            self._bucket().delivered_tokens += num_tokens

    def observe_settlement(self, bill: Bill) -> None:
        with self._lock:
            bucket = self._bucket()
            bucket.billed_prompt_tokens += bill.prompt_tokens
            bucket.settled_requests += 1

    # ---- the view -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The live view as JSON-ready values (docs/console.md describes every field)."""
        with self._lock:
            now_s = int(self._clock())
            self._prune(now_s)
            by_second = {b.second: b for b in self._buckets}
            current = self._queue
            seconds = list(range(now_s - WINDOW_SECONDS, now_s))
            window = [by_second.get(s) or _Bucket(s) for s in seconds]
            shown = self._queue_series(window)
        facts = self.facts
        span = max(1, min(WINDOW_SECONDS, now_s - self._started))
        recent = window[WINDOW_SECONDS - span :]
        return {
            "model": facts.model,
            "model_parameters": facts.num_params,
            "window_seconds": span,
            "peaks": {
                "flops_per_second": facts.peak_flops_per_second,
                "memory_bandwidth_bytes_per_second": facts.peak_memory_bandwidth_bytes_per_second,
            },
            "hardware_price_usd_per_hour": facts.hardware_price_per_second * 3600,
            "now": {
                "num_running": current.num_running,
                "num_waiting": current.num_waiting,
                "kv_cache_usage": current.kv_cache_usage,
                "max_num_seqs": facts.max_num_seqs,
                "kv_cache_capacity_tokens": facts.kv_cache_capacity_tokens,
            },
            "last_minute": self._totals(recent, span),
            "series": self._series(window, shown),
        }

    def _totals(self, buckets: list[_Bucket], span: int) -> dict[str, Any]:
        facts = self.facts
        steps = sum(b.steps for b in buckets)
        prefill_s = sum(b.prefill_seconds for b in buckets)
        decode_s = sum(b.decode_seconds for b in buckets)
        prompt = sum(b.billed_prompt_tokens for b in buckets)
        delivered = sum(b.delivered_tokens for b in buckets)
        price = facts.hardware_price_per_second
        return {
            "steps": steps,
            "forward_passes": sum(b.forward_passes for b in buckets),
            "mean_batch_size": _ratio(sum(b.batch_size_sum for b in buckets), steps),
            "max_batch_size": max((b.batch_size_max for b in buckets), default=0),
            "busy_ratio": (prefill_s + decode_s) / span,
            "mfu": _ratio(sum(b.flops for b in buckets), span * facts.peak_flops_per_second),
            "mbu": _ratio(
                sum(b.bytes for b in buckets), span * facts.peak_memory_bandwidth_bytes_per_second
            ),
            "prompt_tokens_computed_per_second": sum(b.prefill_tokens for b in buckets) / span,
            "generation_tokens_per_second": delivered / span,
            "settled_requests": sum(b.settled_requests for b in buckets),
            "cost_usd_per_million_input_tokens": _ratio(1e6 * price * prefill_s, prompt),
            "cost_usd_per_million_output_tokens": _ratio(1e6 * price * decode_s, delivered),
        }

    def _series(self, window: list[_Bucket], queue: list[_QueueState]) -> dict[str, Any]:
        facts = self.facts
        return {
            "interval_seconds": 1,
            "seconds_ago": [WINDOW_SECONDS - i for i in range(len(window))],
            "num_running": [state.num_running for state in queue],
            "num_waiting": [state.num_waiting for state in queue],
            "kv_cache_usage": [state.kv_cache_usage for state in queue],
            "max_batch_size": [b.batch_size_max for b in window],
            "mfu": [_ratio(b.flops, facts.peak_flops_per_second) or 0.0 for b in window],
            "mbu": [
                _ratio(b.bytes, facts.peak_memory_bandwidth_bytes_per_second) or 0.0 for b in window
            ],
            "prompt_tokens_computed_per_second": [b.prefill_tokens for b in window],
            "generation_tokens_per_second": [b.delivered_tokens for b in window],
        }

    def _queue_series(self, window: list[_Bucket]) -> list[_QueueState]:
        """Each second's peak queue state; a second without a reading shows the last state
        before it (an idle engine reports nothing), starting from the bucket kept before
        the window, else an empty queue."""
        last = _QueueState()
        for bucket in self._buckets:
            if bucket.second < window[0].second and bucket.last is not None:
                last = bucket.last
        shown = []
        for bucket in window:
            shown.append(bucket.peak or last)
            last = bucket.last or last
        return shown

    # ---- buckets (under the lock) -------------------------------------------------------

    def _bucket(self) -> _Bucket:
        second = int(self._clock())
        if not self._buckets or self._buckets[-1].second < second:
            self._buckets.append(_Bucket(second))
            self._prune(second)
        return self._buckets[-1]

    def _prune(self, now_s: int) -> None:
        # Keep one bucket older than the window: it carries the queue state into it.
        while len(self._buckets) > 1 and self._buckets[1].second < now_s - WINDOW_SECONDS:
            self._buckets.popleft()


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None
