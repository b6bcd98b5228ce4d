"""promtool on the shipped Prometheus files, and static checks of the Grafana dashboards."""

from __future__ import annotations

import json
import re
import subprocess

from meter_queries import (
    DASHBOARD_DIR,
    PROMETHEUS_DIR,
    RULE_FILES,
    dashboard_queries,
    rule_queries,
)

from engine.meter.config import MeterConfig
from engine.meter.cost_model import CostModel, ModelShape
from engine.meter.energy import EnergyMeter, rapl_zones
from engine.meter.meter import Meter
from engine.meter.peaks import Peaks
from engine.stats import KVCacheInfo
from server.metering.prometheus_export import ServerMetrics


def _run(args: list[str], stdin: bytes | None = None) -> str:
    result = subprocess.run(
        args, check=False, input=stdin, capture_output=True, timeout=60, cwd=PROMETHEUS_DIR
    )
    output = (result.stdout + result.stderr).decode()
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{output}"
    return output


def test_promtool_check_config(promtool):
    output = _run([promtool, "check", "config", "prometheus.yml"])
    assert "2 rule files found" in output


def test_promtool_check_rules(promtool):
    output = _run([promtool, "check", "rules", *map(str, RULE_FILES)])
    assert output.count("SUCCESS") == len(RULE_FILES)


def test_promtool_rule_unit_tests(promtool):
    # Fixed series with hand-computed cost, MFU, MBU, margin and energy per token, and cost,
    # revenue and margin per tenant; idle guards; each alert firing
    # (deploy/prometheus/tests/rules_test.yml).
    tests = sorted(str(p) for p in (PROMETHEUS_DIR / "tests").glob("*.yml"))
    assert tests
    output = _run([promtool, "test", "rules", *tests])
    assert "SUCCESS" in output


def _server_metrics(tmp_path) -> ServerMetrics:
    # A readable powercap tree so the energy counter is exported too.
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text("0\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    shape = ModelShape(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, num_params=1000, dtype_bytes=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    meter = Meter(
        MeterConfig(peak_flops=1e12, peak_memory_bandwidth=1e10),
        CostModel(shape),
        Peaks(1e12, 1e10, "configured", "configured"),
    )
    return ServerMetrics(
        meter,
        "m",
        KVCacheInfo(block_size=16, num_blocks=8, bytes_per_block=1024),
        shape.num_params,
        max_num_seqs=4,
        energy_meter=EnergyMeter(rapl_zones(tmp_path)),
        tenants=("acme", "default"),
    )


def test_promtool_check_metrics_on_the_exposition(promtool, tmp_path):
    body, _ = _server_metrics(tmp_path).render()
    _run([promtool, "check", "metrics"], stdin=body)


# The series a family of each type exposes, after its `# TYPE` name (counters already end
# in _total there).
_SERIES_SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def _exported_series(body: str) -> set[str]:
    """Every meterserve series name the exposition declares, with or without samples yet.

    Read from the `# TYPE` lines, which prometheus_client writes for a family even before its
    first labelled child exists (a tenant's counters, a rejection reason), plus the sample
    lines; so the check follows whatever server/metering/prometheus_export.py exports, with no
    list to keep.
    """
    names = set(re.findall(r"^(meterserve_\w+)", body, re.MULTILINE))
    for name, kind in re.findall(r"^# TYPE (meterserve_\w+) (\w+)$", body, re.MULTILINE):
        suffixes = _SERIES_SUFFIXES.get(kind, ("",))
        names.update(name + suffix for suffix in suffixes)
    return names


def test_every_series_a_query_uses_is_exported_or_recorded(tmp_path):
    body, _ = _server_metrics(tmp_path).render()
    exported = _exported_series(body.decode())
    queries = dashboard_queries() + rule_queries()
    recorded = {q.name for q in queries if q.kind == "record"}
    unknown = [
        f"{query.source} uses unknown series {name}"
        for query in queries
        for name in re.findall(r"\bmeterserve[_:][\w:]+", query.expr)
        if name not in exported | recorded
    ]
    assert not unknown, "\n".join(unknown)


def test_dashboards_are_well_formed():
    uids = set()
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        board = json.loads(path.read_text())
        assert board["uid"] not in uids
        uids.add(board["uid"])
        variables = {v["name"] for v in board["templating"]["list"]}
        assert variables == {"datasource", "model"}
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, f"{path.name}: {panel['title']} overflows"
            if panel["type"] == "row":
                # Expanded rows only: a collapsed row nests its panels, out of meter_queries' sight.
                assert not panel["collapsed"] and not panel["panels"], path.name
                assert "targets" not in panel, path.name
                continue
            assert panel["targets"], f"{path.name}: {panel['title']} has no query"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert 'model=~"$model"' in target["expr"], target["expr"]
    assert {p.name for p in DASHBOARD_DIR.glob("*.json")} == {
        "cost.json",
        "utilization.json",
        "latency-traffic.json",
    }
