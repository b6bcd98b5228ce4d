"""EnergyMeter reading real powercap-format files (a sysfs tree laid out in a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.meter.energy import POWERCAP_ROOT, EnergyMeter, RaplZone, rapl_zones


def _zone(
    root: Path, name: str, label: str, energy_uj: int, range_uj: int = 262_143_328_850
) -> Path:
    path = root / name
    path.mkdir()
    (path / "name").write_text(label + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{range_uj}\n")
    return path


def test_rapl_zone_accumulates_and_unwraps_the_counter(tmp_path):
    path = _zone(tmp_path, "intel-rapl:0", "package-0", energy_uj=900_000, range_uj=1_000_000)
    zone = RaplZone(path)
    assert zone.read_joules() == 0.0
    (path / "energy_uj").write_text("950000\n")
    assert zone.read_joules() == pytest.approx(0.05)
    # Wraps at 1_000_000 uJ: 950_000 -> 20_000 is 70_000 uJ more.
    (path / "energy_uj").write_text("20000\n")
    assert zone.read_joules() == pytest.approx(0.12)
    (path / "energy_uj").write_text("520000\n")
    assert zone.read_joules() == pytest.approx(0.62)


def test_only_package_zones_are_summed(tmp_path):
    a = _zone(tmp_path, "intel-rapl:0", "package-0", energy_uj=0)
    b = _zone(tmp_path, "intel-rapl:1", "package-1", energy_uj=0)
    _zone(tmp_path, "intel-rapl:2", "psys", energy_uj=0)  # whole platform: would double count
    _zone(tmp_path, "intel-rapl:0:0", "core", energy_uj=0)  # part of package-0
    _zone(tmp_path, "intel-rapl-mmio:0", "package-0", energy_uj=0)  # same package via MMIO
    meter = EnergyMeter(rapl_zones(tmp_path))
    assert meter.available and meter.source == "rapl"
    assert meter.joules() == 0.0
    (a / "energy_uj").write_text("2000000\n")
    (b / "energy_uj").write_text("500000\n")
    (tmp_path / "intel-rapl:2" / "energy_uj").write_text("9000000\n")
    (tmp_path / "intel-rapl:0:0" / "energy_uj").write_text("9000000\n")
    assert meter.joules() == pytest.approx(2.5)


def test_unreadable_zones_make_the_meter_unavailable(tmp_path):
    path = tmp_path / "intel-rapl:0"
    path.mkdir()
    (path / "name").write_text("package-0\n")
    (path / "energy_uj").mkdir()  # reading it raises IsADirectoryError, like EACCES would
    (path / "max_energy_range_uj").write_text("1000\n")
    meter = EnergyMeter(rapl_zones(tmp_path))
    assert not meter.available
    assert meter.source == "none"
    with pytest.raises(RuntimeError):
        meter.joules()


def test_detect_on_this_machine_matches_what_sysfs_exposes():
    meter = EnergyMeter.detect()
    readable = any(
        (p / "energy_uj").is_file() and _readable(p / "energy_uj")
        for p in POWERCAP_ROOT.glob("intel-rapl:*")
    )
    if meter.source in ("none", "rapl"):
        assert meter.available == readable
    if meter.available:
        first = meter.joules()
        assert meter.joules() >= first >= 0.0


def _readable(path: Path) -> bool:
    try:
        int(path.read_text())
    except (OSError, ValueError):
        return False
    return True
