"""Peaks: the CPU's attainable FLOP/s and memory bandwidth, configured or measured in < 2 s.

Used for MFU, MBU and the roofline cost split. When the operator did not configure them, they
are measured on the CPU, the device that does all of meterserve's work: what this machine
demonstrably sustains on a large matmul and a large copy (an attainable peak, lower than a
datasheet peak, so the ratios read higher than vendor-based ones; the exported `source` label
says which kind was used). A CUDA device is never measured: nothing runs on it, and its peaks
would make the CPU's work look nearly free. Measurements are cached per process and dtype, so
several engines in one process (tests, benchmarks) measure once.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MATMUL_SIZE = 1024  # large enough to leave the cache-bound regime, small enough for 2 cores
COPY_BYTES = 256 * 1024 * 1024  # src + dst 512 MiB: beyond any last-level cache
MATMUL_SECONDS = 0.6
COPY_SECONDS = 0.4


@dataclass(frozen=True, slots=True)
class Peaks:
    """The denominators of MFU and MBU; `*_source` is "configured" or "measured"."""

    flops_per_second: float
    bytes_per_second: float
    flops_source: str = "measured"
    bytes_source: str = "measured"


def resolve_peaks(
    flops_per_second: float | None, bytes_per_second: float | None, dtype: torch.dtype
) -> Peaks:
    """Configured peaks where given, the CPU's measured ones for the rest."""
    warn_if_cuda_unused()
    if flops_per_second is not None and bytes_per_second is not None:
        return Peaks(flops_per_second, bytes_per_second, "configured", "configured")
    measured = measure_peaks(dtype)
    return Peaks(
        flops_per_second if flops_per_second is not None else measured.flops_per_second,
        bytes_per_second if bytes_per_second is not None else measured.bytes_per_second,
        "configured" if flops_per_second is not None else "measured",
        "configured" if bytes_per_second is not None else "measured",
    )


@functools.cache
def measure_peaks(dtype: torch.dtype = torch.float32) -> Peaks:
    """Best-of-repeats throughput of a square matmul and a tensor copy on the CPU."""
    device = torch.device("cpu")
    return Peaks(
        flops_per_second=_matmul_flops_per_second(dtype, device),
        bytes_per_second=_copy_bytes_per_second(device),
    )


@functools.cache
def warn_if_cuda_unused() -> None:
    """Say once that a CUDA device is present but idle: the meter measures the CPU."""
    if torch.cuda.is_available():
        log.warning(
            "a CUDA device is present but unused: meterserve computes on the CPU only, and "
            "the meter measures the CPU's peaks and energy"
        )


def _matmul_flops_per_second(dtype: torch.dtype, device: torch.device) -> float:
    n = MATMUL_SIZE
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    best = _best_seconds(lambda: torch.matmul(a, b, out=out), device, MATMUL_SECONDS)
    return 2.0 * n**3 / best


def _copy_bytes_per_second(device: torch.device) -> float:
    src = torch.ones(COPY_BYTES // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = _best_seconds(lambda: dst.copy_(src), device, COPY_SECONDS)
    return 2.0 * COPY_BYTES / best  # a copy reads and writes every byte


def _best_seconds(run: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """Shortest of repeated runs within budget_s, after one warm-up run.

    The best, not the mean, because the attainable peak is what we want and other processes
    sharing the machine only ever make a run slower.
    """
    run()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
        if time.perf_counter() >= deadline:
            return best
