"""measure_peaks: the machine's attainable FLOP/s and memory bandwidth, measured in < 2 s.

Used when the operator did not configure peaks: MFU and MBU then compare the model's work
with what this machine demonstrably sustains on a large matmul and a large copy (an
attainable peak, lower than a datasheet peak, so the ratios read higher than vendor-based
ones; the exported `source` label says which kind was used).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

MATMUL_SIZE = 1024  # large enough to leave the cache-bound regime, small enough for 2 cores
COPY_BYTES = 64 * 1024 * 1024  # well beyond any last-level cache
MATMUL_SECONDS = 0.6
COPY_SECONDS = 0.4


@dataclass(frozen=True, slots=True)
class Peaks:
    flops_per_second: float
    bytes_per_second: float


def measure_peaks(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Peaks:
    """Best-of-repeats throughput of a square matmul and a tensor copy on `device`."""
    device = torch.device(device)
    return Peaks(
        flops_per_second=_matmul_flops_per_second(dtype, device),
        bytes_per_second=_copy_bytes_per_second(device),
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
    _synchronize(device)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        started = time.perf_counter()
        run()
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
        if time.perf_counter() >= deadline:
            return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
