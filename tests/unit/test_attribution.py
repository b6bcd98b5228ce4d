"""The roofline cost split on constructed steps, against shares computed by hand."""

from __future__ import annotations

import pytest

from engine.meter.attribution import roofline_seconds, split_step_time

# A round machine: 1 TFLOP/s, 100 GB/s.
PEAK_FLOPS, PEAK_BW = 1e12, 1e11


def test_roofline_is_the_slower_of_compute_and_memory():
    assert roofline_seconds(2e9, 1e6, PEAK_FLOPS, PEAK_BW) == 2e-3  # compute: 2 ms > 10 us
    assert roofline_seconds(1e6, 5e8, PEAK_FLOPS, PEAK_BW) == 5e-3  # memory: 5 ms > 1 us


def test_pure_prefill_gets_the_whole_step():
    assert split_step_time(0.123, [5e11], [3e8], PEAK_FLOPS, PEAK_BW) == [0.123]


def test_equal_decodes_split_evenly_and_sum_to_the_step():
    shares = split_step_time(0.04, [3e8] * 4, [7e7] * 4, PEAK_FLOPS, PEAK_BW)
    assert shares == pytest.approx([0.01] * 4)
    assert sum(shares) == pytest.approx(0.04, rel=1e-12)


def test_a_decode_at_long_context_pays_for_its_kv_reads():
    # Same FLOPs (0.3 ms of compute each); the second reads 50 MB of KV (0.5 ms) and is
    # memory-bound: 0.3 : 0.5 of a 16 ms step -> 6 ms and 10 ms. A FLOPs split would say 8 / 8.
    shares = split_step_time(0.016, [3e8, 3e8], [1e6, 5e7], PEAK_FLOPS, PEAK_BW)
    assert shares == pytest.approx([0.006, 0.010])


def test_one_prefill_chunk_and_64_decodes():
    # Prefill: 512 tokens * 0.27 GFLOP = 138.24 GFLOP -> 138.24 ms compute; its bytes
    # (512/576 of 270 MB weights = 240 MB -> 2.4 ms) are not the bound.
    # Each decode: 0.27 GFLOP -> 0.27 ms compute; bytes = 270 MB / 576 = 0.46875 MB of weights
    # + 4.6 MB KV at context 200 = 5.06875 MB -> 0.0506875 ms: compute-bound, 0.27 ms.
    # Bounds: 138.24 + 64 * 0.27 = 155.52 ms; measured step 311.04 ms = 2x the bounds.
    weights = 270e6
    prefill_bytes = weights * 512 / 576
    decode_bytes = weights / 576 + 4.6e6
    flops = [512 * 0.27e9] + [0.27e9] * 64
    num_bytes = [prefill_bytes] + [decode_bytes] * 64
    shares = split_step_time(0.31104, flops, num_bytes, PEAK_FLOPS, PEAK_BW)
    assert shares[0] == pytest.approx(0.27648)  # 2 x 138.24 ms
    assert shares[1:] == pytest.approx([0.00054] * 64)  # 2 x 0.27 ms each
    assert sum(shares) == pytest.approx(0.31104, rel=1e-12)


def test_a_step_with_no_modelled_work_is_shared_evenly():
    assert split_step_time(0.01, [0.0, 0.0], [0.0, 0.0], PEAK_FLOPS, PEAK_BW) == [0.005, 0.005]
    assert split_step_time(0.01, [], [], PEAK_FLOPS, PEAK_BW) == []
