"""EnergyMeter: joules consumed by this machine's CPU packages (RAPL).

Only real readings: a source that cannot be read is left out, and with none left the meter
says `available = False` and reports no joules at all (never a made-up estimate).

RAPL (Linux powercap): /sys/class/powercap/intel-rapl:<N>/energy_uj is a microjoule counter
per CPU package that wraps at max_energy_range_uj; AMD CPUs expose the same files. Only the
top-level package zones are summed: their subzones (core, uncore, dram) are parts of them,
and a "psys" zone covers the whole platform including the packages. The files are often
readable by root only, in which case RAPL is unavailable.

GPUs are not read: meterserve computes on the CPU only, so a GPU's energy is not the cost of
its work (a present but unused CUDA device is logged at start-up by engine.meter.peaks).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Protocol

POWERCAP_ROOT = Path("/sys/class/powercap")
_PACKAGE_ZONE = re.compile(r"^intel-rapl:\d+$")


class EnergySource(Protocol):
    name: str

    def read_joules(self) -> float:
        """Joules consumed since this source was opened; never decreases."""
        ...


class RaplZone:
    """One powercap zone's energy counter, unwrapped into a monotonic total."""

    def __init__(self, path: Path) -> None:
        self.name = "rapl"
        self._energy_file = path / "energy_uj"
        self._range_uj = int((path / "max_energy_range_uj").read_text())
        self._last_uj = self._read_uj()
        self._total_uj = 0

    def _read_uj(self) -> int:
        return int(self._energy_file.read_text())

    def read_joules(self) -> float:
        now = self._read_uj()
        delta = now - self._last_uj
        if delta < 0:  # the counter wrapped past max_energy_range_uj back to 0
            delta += self._range_uj
        self._total_uj += delta
        self._last_uj = now
        return self._total_uj / 1e6


def rapl_zones(root: Path = POWERCAP_ROOT) -> list[RaplZone]:
    """Readable top-level RAPL zones; the "package-*" ones when any is named so."""
    candidates = sorted(p for p in root.glob("intel-rapl:*") if _PACKAGE_ZONE.match(p.name))
    packages = [p for p in candidates if _zone_name(p).startswith("package")]
    zones = []
    for path in packages or candidates:
        if _zone_name(path) == "psys" and packages:
            continue
        try:
            zones.append(RaplZone(path))
        except (OSError, ValueError):  # permission denied (root-only files) or garbage
            continue
    return zones


def _zone_name(path: Path) -> str:
    try:
        return (path / "name").read_text().strip()
    except OSError:
        return ""


class EnergyMeter:
    """Sum of the machine's readable energy counters, in joules since the meter was made.

    `available` is False when there is no readable source; joules() then raises, so nothing
    can export a fake zero. Thread-safe.
    """

    def __init__(self, sources: list[EnergySource]) -> None:
        self._sources = list(sources)
        self._lock = threading.Lock()

    @classmethod
    def detect(cls, powercap_root: Path = POWERCAP_ROOT) -> EnergyMeter:
        return cls(list(rapl_zones(powercap_root)))

    @property
    def available(self) -> bool:
        return bool(self._sources)

    @property
    def source(self) -> str:
        """Which sources are summed: rapl, or none."""
        names = sorted({source.name for source in self._sources})
        return "+".join(names) or "none"

    def joules(self) -> float:
        if not self._sources:
            raise RuntimeError("no readable energy source on this machine")
        with self._lock:
            return sum(source.read_joules() for source in self._sources)
