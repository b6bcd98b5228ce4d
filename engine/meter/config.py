"""MeterConfig: the prices, peaks and SLOs that turn engine measurements into cost, frozen."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.meter.billing import Prices

# AWS c7i.large on demand in us-east-1 (2 vCPU, 4 GiB): USD 0.08925 per hour, the price of a
# replica like the 2-core machine this project is developed on. Set the replica's real price.
DEFAULT_HARDWARE_PRICE_PER_HOUR = 0.08925


@dataclass(frozen=True, slots=True)
class MeterConfig:
    """What the meter cannot measure: money, hardware peaks, latency objectives.

    Prices are USD. Revenue prices are the list prices charged per 1M tokens (placeholders
    in the range hosted sub-1B models sell at). A peak left None is measured at start-up with
    engine.meter.peaks.measure_peaks, and the exported metrics say "measured" instead of
    "configured".
    """

    hardware_price_per_hour: float = DEFAULT_HARDWARE_PRICE_PER_HOUR
    price_per_million_input_tokens: float = 0.05
    price_per_million_output_tokens: float = 0.10
    peak_flops: float | None = None  # FLOP/s of the replica's accelerator or CPUs
    peak_memory_bandwidth: float | None = None  # bytes/s
    slo_ttft_seconds: float = 2.0  # time to first token a request must meet to count as goodput
    slo_itl_seconds: float = 0.25  # mean inter-token latency (time per output token) likewise
    # Alert when the allocation-basis cost per 1M output tokens exceeds this.
    cost_ceiling_per_million_output_tokens: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "hardware_price_per_hour",
            "price_per_million_input_tokens",
            "price_per_million_output_tokens",
            "cost_ceiling_per_million_output_tokens",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("peak_flops", "peak_memory_bandwidth"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0 or unset (measured), got {value}")
        for name in ("slo_ttft_seconds", "slo_itl_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")

    @property
    def hardware_price_per_second(self) -> float:
        return self.hardware_price_per_hour / 3600.0

    @property
    def default_prices(self) -> Prices:
        """The list prices of requests whose tenant has no price plan of its own."""
        return Prices(self.price_per_million_input_tokens, self.price_per_million_output_tokens)
