"""Admission: queue limits and a Retry-After that follows the queue size and drain rate."""

from __future__ import annotations

import pytest

from server.admission import RETRY_AFTER_MAX_S, Admission


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


def test_retry_after_follows_queue_and_drain_rate():
    admission = Admission(max_waiting_requests=4, max_queued_tokens=10_000)
    # 10 requests left the queue over 5 s: 2 requests/s.
    for i in range(10):
        admission.enter(100)
        admission.leave(100, now=100.0 + i * 5 / 9)
    for _ in range(4):
        admission.enter(100)
    rejection = admission.check(1, 100, now=105.0)
    assert rejection.retry_after_s == 2  # 4 queued / 2 per s
    for _ in range(4):
        admission.leave(100, now=105.0)
    for _ in range(4):
        admission.enter(100)
    # Slower drain later (the window keeps only recent departures) gives a longer wait.
    assert admission.check(1, 100, now=134.0).retry_after_s > 2


def test_retry_after_without_recent_departures_is_the_window():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10_000, window_s=30.0)
    admission.enter(5)
    assert admission.check(1, 5, now=0.0).retry_after_s == 30


def test_retry_after_is_bounded():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10**9, window_s=1000.0)
    admission.enter(5)
    admission.leave(5, now=0.0)
    admission.enter(5)
    assert admission.check(1, 5, now=999.0).retry_after_s == RETRY_AFTER_MAX_S


def test_leave_more_than_entered_is_a_bug():
    admission = Admission(max_waiting_requests=1, max_queued_tokens=10)
    with pytest.raises(AssertionError):
        admission.leave(1, now=0.0)
