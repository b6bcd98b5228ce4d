"""Admission: queue limits, and a Retry-After that estimates when the refused group would fit.

Every clock is a plain float `now`; the expected Retry-After values are worked out by hand.
"""

from __future__ import annotations

import pytest

from server.engine_client.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Admission


def serve(admission: Admission, num_tokens: int, times: list[float]) -> None:
    """Queue one request of `num_tokens` per time and let it reach its first token then."""
    for at in times:
        admission.enter(num_tokens)
        admission.leave(num_tokens, now=at, served=True)


def fill(admission: Admission, num_requests: int, num_tokens: int) -> None:
    for _ in range(num_requests):
        admission.enter(num_tokens)


def test_empty_queue_admits_even_an_oversized_group():
    admission = Admission(max_waiting_requests=2, max_queued_tokens=100)
    assert admission.check(num_requests=5, num_tokens=1000, now=0.0) is None


def test_request_limit():
    admission = Admission(max_waiting_requests=2, max_queued_tokens=10_000)
    admission.enter(10)
    assert admission.check(1, 10, now=0.0) is None
    admission.enter(10)
    rejection = admission.check(1, 10, now=0.0)
    assert rejection is not None and rejection.reason == "queue_full"
    assert "2 requests are waiting (limit 2)" in rejection.message


def test_token_limit():
    admission = Admission(max_waiting_requests=100, max_queued_tokens=50)
    admission.enter(40)
    assert admission.check(1, 10, now=0.0) is None
    rejection = admission.check(1, 11, now=0.0)
    assert rejection is not None and rejection.reason == "queued_tokens_full"
    assert "40 prompt tokens are waiting (limit 50)" in rejection.message


def test_retry_after_follows_drain_rate():
    admission = Admission(max_waiting_requests=4, max_queued_tokens=10_000, window_s=30.0)
    # 10 served at 100.0, 100.5, ..., 104.5; at now=105 the span is 5 s: 2 requests/s.
    serve(admission, 100, [100.0 + i * 0.5 for i in range(10)])
    fill(admission, 4, 100)
    assert admission.drain_rate(now=105.0, by_tokens=False) == 2.0
    # One request: 4 + 1 - 4 = 1 must leave, 1 / 2 = 0.5 s, rounded up to 1.
    assert admission.check(1, 100, now=105.0).retry_after_s == 1
    # Three requests: 4 + 3 - 4 = 3 must leave, 3 / 2 = 1.5 s, rounded up to 2.
    assert admission.check(3, 300, now=105.0).retry_after_s == 2
    for _ in range(4):
        admission.leave(100, now=105.0, served=True)
    fill(admission, 4, 100)
    # At now=134 the window keeps departures at >= 104: 104.0, 104.5 and the four at 105.0,
    # 6 over 134 - 104 = 30 s = 0.2 requests/s. 1 must leave: 1 / 0.2 = 5 s.
    assert admission.check(1, 100, now=134.0).retry_after_s == 5


def test_slot_that_frees_soon_gives_short_retry_after_despite_long_queue():
    admission = Admission(max_waiting_requests=50, max_queued_tokens=10**6)
    serve(admission, 10, [100.0 + i * 0.5 for i in range(10)])  # 2 requests/s at now=105
    fill(admission, 50, 10)
    # Draining the whole queue would take 50 / 2 = 25 s; one slot frees in 1 / 2 = 0.5 -> 1 s.
    assert admission.check(1, 10, now=105.0).retry_after_s == 1
    # A group of 5 needs 50 + 5 - 50 = 5 to leave: 5 / 2 = 2.5 -> 3 s.
    assert admission.check(5, 50, now=105.0).retry_after_s == 3


def test_group_larger_than_the_limit_waits_for_the_whole_queue_only():
    admission = Admission(max_waiting_requests=2, max_queued_tokens=10**6, window_s=30.0)
    serve(admission, 10, [0.0, 2.0, 4.0])  # 3 served over now - 0 = 6 s: 0.5 requests/s
    fill(admission, 2, 10)
    # 2 + 5 - 2 = 5 exceeds the 2 queued; the empty queue admits the group once both left:
    # 2 / 0.5 = 4 s (not 5 / 0.5 = 10 s).
    assert admission.check(5, 50, now=6.0).retry_after_s == 4


def test_unserved_departures_do_not_raise_the_drain_rate():
    admission = Admission(max_waiting_requests=4, max_queued_tokens=10**6, window_s=30.0)
    serve(admission, 10, [0.0])  # 1 served over now - 0 = 10 s: 0.1 requests/s
    # 20 requests time out or disconnect just before now: room, but no evidence of speed.
    fill(admission, 20, 10)
    for _ in range(20):
        admission.leave(10, now=9.5, served=False)
    assert admission.num_queued == 0 and admission.queued_tokens == 0
    fill(admission, 4, 10)
    assert admission.drain_rate(now=10.0, by_tokens=False) == 0.1
    assert admission.drain_rate(now=10.0, by_tokens=True) == 1.0  # 10 tokens / 10 s
    # 1 must leave: 1 / 0.1 = 10 s. Had the 20 counted: 21 / 10 s, 1 / 2.1 -> 1 s.
    assert admission.check(1, 10, now=10.0).retry_after_s == 10


def test_only_unserved_departures_fall_back_to_the_window():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10_000, window_s=30.0)
    fill(admission, 3, 5)
    admission.leave(5, 1.0, False)  # positional form
    admission.leave(5, now=2.0, served=False)
    assert admission.num_queued == 1 and admission.queued_tokens == 5
    assert admission.drain_rate(now=3.0, by_tokens=False) is None
    assert admission.check(1, 5, now=3.0).retry_after_s == 30


def test_leave_defaults_to_served():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10_000)
    admission.enter(5)
    admission.leave(5, now=0.0)
    assert admission.drain_rate(now=0.0, by_tokens=False) == 1.0  # 1 over the 1 s floor


def test_token_limit_retry_after_follows_token_drain_rate():
    admission = Admission(max_waiting_requests=100, max_queued_tokens=1000, window_s=30.0)
    serve(admission, 250, [0.0, 1.0, 2.0, 3.0])  # 1000 tokens over now - 0 = 4 s: 250/s
    # A timed-out 10,000-token prompt neither adds to the token rate nor stays queued.
    admission.enter(10_000)
    admission.leave(10_000, now=3.5, served=False)
    fill(admission, 3, 300)  # 900 queued tokens
    assert admission.drain_rate(now=4.0, by_tokens=True) == 250.0
    assert admission.check(1, 100, now=4.0) is None  # 900 + 100 = 1000 fits
    # 900 + 400 - 1000 = 300 tokens must leave: 300 / 250 = 1.2 -> 2 s.
    rejection = admission.check(1, 400, now=4.0)
    assert rejection.reason == "queued_tokens_full" and rejection.retry_after_s == 2
    # 900 + 1200 - 1000 = 1100 exceeds the 900 queued: 900 / 250 = 3.6 -> 4 s.
    assert admission.check(1, 1200, now=4.0).retry_after_s == 4


def test_retry_after_without_recent_departures_is_the_window():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10_000, window_s=30.0)
    admission.enter(5)
    assert admission.check(1, 5, now=0.0).retry_after_s == 30
    # Departures older than the window are forgotten: 40 - 5 = 35 s > 30 s.
    serve(admission, 5, [5.0])
    assert admission.check(1, 5, now=40.0).retry_after_s == 30


def test_fallback_window_is_capped():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10_000, window_s=600.0)
    admission.enter(5)
    assert admission.check(1, 5, now=0.0).retry_after_s == RETRY_AFTER_MAX_S == 120


def test_retry_after_is_capped():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10**9, window_s=1000.0)
    serve(admission, 5, [0.0])
    admission.enter(5)
    # 1 served over 999 s: 1 must leave in 999 s, capped to 120.
    assert admission.check(1, 5, now=999.0).retry_after_s == RETRY_AFTER_MAX_S == 120


def test_burst_reads_as_a_rate_over_one_second_and_the_floor_holds():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10**9)
    # 100 served at the same instant: span max(10 - 10, 1 s) = 1 s, 100 requests/s.
    serve(admission, 5, [10.0] * 100)
    admission.enter(5)
    assert admission.drain_rate(now=10.0, by_tokens=False) == 100.0
    # 1 / 100 = 0.01 s, rounded up to the 1 s floor.
    assert admission.check(1, 5, now=10.0).retry_after_s == RETRY_AFTER_MIN_S == 1


def test_leave_more_than_entered_is_a_bug():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10)
    with pytest.raises(AssertionError):
        admission.leave(1, now=0.0)
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10)
    with pytest.raises(AssertionError):
        admission.leave(1, now=0.0, served=False)
