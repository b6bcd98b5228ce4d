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

from engine.energy import EnergyMeter, rapl_zones
from engine.stats import KVCacheInfo
from server.meter_config import MeterConfig
from server.metrics import ServerMetrics


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
    # Fixed series with hand-computed cost, MFU, MBU, margin and energy per token; idle
    # guards; each alert firing (deploy/prometheus/tests/rules_test.yml).
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
    return ServerMetrics(
        MeterConfig(peak_flops=1e12, peak_memory_bandwidth=1e10),
        "m",
        KVCacheInfo(block_size=16, num_blocks=8, bytes_per_block=1024),
        1000,
        2,
        max_num_seqs=4,
        energy_meter=EnergyMeter(rapl_zones(tmp_path)),
    )


def test_promtool_check_metrics_on_the_exposition(promtool, tmp_path):
    body, _ = _server_metrics(tmp_path).render()
    _run([promtool, "check", "metrics"], stdin=body)


def test_every_series_a_query_uses_is_exported_or_recorded(tmp_path):
    metrics = _server_metrics(tmp_path)
    metrics.observe_rejection("queue_full")  # labelled by reason: exists after the first one
    body, _ = metrics.render()
    exported = set(re.findall(r"^(meterserve_\w+)", body.decode(), re.MULTILINE))
    queries = dashboard_queries() + rule_queries()
    recorded = {q.name for q in queries if q.kind == "record"}
    for query in queries:
        for name in re.findall(r"\bmeterserve[_:][\w:]+", query.expr):
            assert name in exported | recorded, f"{query.source} uses unknown series {name}"


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
            assert panel["targets"], f"{path.name}: {panel['title']} has no query"
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, f"{path.name}: {panel['title']} overflows"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert 'model=~"$model"' in target["expr"], target["expr"]
    assert {p.name for p in DASHBOARD_DIR.glob("*.json")} == {
        "cost.json",
        "utilization.json",
        "latency-traffic.json",
    }
