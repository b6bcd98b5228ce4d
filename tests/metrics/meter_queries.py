"""Every PromQL expression meterserve ships (dashboards and rules), for the metrics tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
# What the tests put in for Grafana's variables: all models, and windows (rate interval and
# the dashboard's time range) longer than the whole end-to-end run so rates cover all of it.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__range": "2m", "$model": ".+"}


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL expression we ship, and where it comes from."""

    source: str  # "cost.json: Cost per 1M input tokens [A]" or "recording.yml: <record>"
    expr: str
    kind: str  # "panel", "record" or "alert"
    name: str  # panel title, recorded series name or alert name


def substitute_grafana_variables(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def dashboard_queries() -> list[Query]:
    queries = []
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            if panel["type"] == "row":  # a section header: no query (test_promtool checks)
                continue
            for target in panel["targets"]:
                queries.append(
                    Query(
                        source=f"{path.name}: {panel['title']} [{target['refId']}]",
                        expr=substitute_grafana_variables(target["expr"]),
                        kind="panel",
                        name=panel["title"],
                    )
                )
    return queries


def rule_queries() -> list[Query]:
    queries = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                kind = "record" if "record" in rule else "alert"
                name = rule.get("record") or rule["alert"]
                queries.append(Query(f"{path.name}: {name}", rule["expr"], kind, name))
    return queries
