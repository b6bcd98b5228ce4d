"""Distribution: count, mean and p50/p90/p99 of a list of latencies (seconds)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(0, None, None, None, None)
        ordered = sorted(values)
        return cls(
            count=len(ordered),
            mean=sum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of a sorted list."""
    if not ordered:
        raise ValueError("percentile of an empty list")
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
