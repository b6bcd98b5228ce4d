"""EnergyCollector: the machine's energy counter, read at scrape time, as Prometheus metrics."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.meter.energy import EnergyMeter

PREFIX = "meterserve_"


class EnergyCollector:
    """Reads the energy meter at scrape time; exports joules only when a source is readable."""

    def __init__(self, meter: EnergyMeter, model_name: str) -> None:
        self._meter = meter
        self._model_name = model_name

    def collect(self) -> Any:
        available = GaugeMetricFamily(
            PREFIX + "energy_available",
            "1 when an energy counter (RAPL) is readable, else 0.",
            labels=("model", "source"),
        )
        available.add_metric((self._model_name, self._meter.source), float(self._meter.available))
        yield available
        if not self._meter.available:
            return
        joules = self._meter.joules()
        if not math.isfinite(joules):
            return
        total = CounterMetricFamily(
            PREFIX + "energy_joules",
            "Energy consumed by the machine's CPU packages and GPUs since start-up.",
            labels=("model",),
        )
        total.add_metric((self._model_name,), joules)
        yield total
