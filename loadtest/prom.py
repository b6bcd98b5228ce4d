"""Scrape: one reading of a Prometheus text-format /metrics page, and sums over its series.

A small parser of the exposition format (name{label="value",...} value [timestamp]) so the
load generator needs no prometheus_client. No locust import here.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Series:
    labels: dict[str, str]
    value: float


@dataclass(slots=True)
class Scrape:
    """Samples by metric name, taken at `taken_at` (time.time())."""

    taken_at: float
    samples: dict[str, list[Series]] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.samples

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`; 0 when none."""
        return sum(
            s.value
            for s in self.samples.get(name, ())
            if all(s.labels.get(k) == v for k, v in labels.items()) and math.isfinite(s.value)
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.samples.get(name, ()):
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0.0) + s.value
        return out

    def label_value(self, name: str, label: str) -> str | None:
        series = self.samples.get(name)
        return series[0].labels.get(label) if series else None


def parse_metrics(text: str, taken_at: float | None = None) -> Scrape:
    scrape = Scrape(taken_at=time.time() if taken_at is None else taken_at)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, raw_labels, raw_value = match.groups()
        labels = {k: _unescape(v) for k, v in _LABEL.findall(raw_labels or "")}
        scrape.samples.setdefault(name, []).append(Series(labels, _float(raw_value)))
    return scrape


def scrape(base_url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> Scrape:
    response = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout, headers=headers)
    response.raise_for_status()
    return parse_metrics(response.text)


def _float(raw: str) -> float:
    if raw in ("+Inf", "Inf"):
        return math.inf
    if raw == "-Inf":
        return -math.inf
    return float(raw)


def _unescape(value: str) -> str:
    return value.replace(r"\"", '"').replace(r"\n", "\n").replace("\\\\", "\\")
