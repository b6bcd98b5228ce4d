"""deploy/docker-compose.yml: parses, mounts files that exist, and its three services line up.

Docker cannot run on the CI machine, so `docker compose up` is not executed here. What is
checked instead: every bind mount names an existing file or directory; Prometheus scrapes the
meterserve service on its container port; Grafana's datasource points at the prometheus service;
the dashboards directory Grafana's provider reads is mounted; the home dashboard is the cost
dashboard and its panels use the provisioned datasource.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import pytest
from deploy_support import DEPLOY, REPO, load_yaml, require_file, settings_env_names

COMPOSE = DEPLOY / "docker-compose.yml"


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


def bind_mounts(service: str) -> list[tuple[Path, PurePosixPath]]:
    """(host path, container path) of the service's bind mounts; named volumes left out."""
    mounts = []
    for volume in compose()["services"][service].get("volumes", ()):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((DEPLOY / source).resolve(), PurePosixPath(target)))
    return mounts


def host_path(service: str, container_path: str) -> Path:
    """Where a path inside the service's container comes from on the host (longest mount)."""
    path = PurePosixPath(container_path)
    best = None
    for host, target in bind_mounts(service):
        covers = path == target or target in path.parents
        if covers and (best is None or len(target.parts) > len(best[1].parts)):
            best = (host, target)
    assert best is not None, f"{container_path} is not mounted into {service}"
    host, target = best
    return host.joinpath(*path.relative_to(target).parts)


def container_ports(service: str) -> set[int]:
    return {
        int(str(p).rsplit(":", 1)[-1].split("/")[0])
        for p in compose()["services"][service]["ports"]
    }


def env_default(value: str) -> str:
    """'${NAME:-default}' -> 'default'; plain values unchanged."""
    match = re.fullmatch(r"\$\{\w+:-(.*)\}", str(value))
    return match.group(1) if match else str(value)


def test_services_and_pinned_images() -> None:
    services = compose()["services"]
    assert {"meterserve", "prometheus", "grafana"} <= set(services)
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), image


@pytest.mark.parametrize("service", ["meterserve", "prometheus", "grafana"])
def test_every_bind_mount_exists(service: str) -> None:
    for host, _ in bind_mounts(service):
        require_file(host)


def test_meterserve_builds_the_repository_dockerfile() -> None:
    server = compose()["services"]["meterserve"]
    context = (DEPLOY / server["build"]["context"]).resolve()
    assert context == REPO
    assert (context / server["build"]["dockerfile"]).resolve() == REPO / "Dockerfile"
    dockerfile = (REPO / "Dockerfile").read_text()
    arg = env_default(server["build"]["args"]["TORCH_INDEX_URL"])
    assert f"ARG TORCH_INDEX_URL={arg}\n" in dockerfile
    assert 8000 in container_ports("meterserve")
    environment = server.get("environment", {})
    assert set(environment) <= settings_env_names(), set(environment) - settings_env_names()
    # docker stop waits stop_grace_period before SIGKILL: longer than the server's drain.
    drain = float(env_default(environment.get("METERSERVE_DRAIN_GRACE_PERIOD", "30")))
    assert float(server["stop_grace_period"].removesuffix("s")) > drain
    assert server["init"] is True


def test_prometheus_scrapes_meterserve_and_loads_the_rules() -> None:
    service = compose()["services"]["prometheus"]
    config_arg = next(a for a in service["command"] if a.startswith("--config.file="))
    config_path = config_arg.split("=", 1)[1]
    config = load_yaml(host_path("prometheus", config_path))
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", ())
        for target in static["targets"]
    }
    assert {f"meterserve:{port}" for port in container_ports("meterserve")} & targets, targets
    rule_files = config.get("rule_files", [])
    assert rule_files, "prometheus.yml loads no rule files"
    for pattern in rule_files:
        absolute = PurePosixPath(config_path).parent / pattern  # relative to the config file
        matched = glob.glob(str(host_path("prometheus", str(absolute))))
        assert matched, f"rule_files entry {pattern} matches nothing under deploy/prometheus"
        for path in matched:
            assert load_yaml(Path(path))["groups"], path


def grafana_provisioning(kind: str) -> list[dict[str, Any]]:
    directory = host_path("grafana", f"/etc/grafana/provisioning/{kind}")
    files = sorted(require_file(directory).glob("*.y*ml"))
    assert files, f"no {kind} provisioning files in {directory.relative_to(REPO)}"
    return [load_yaml(path) for path in files]


def test_grafana_datasource_is_the_prometheus_service() -> None:
    sources = [s for f in grafana_provisioning("datasources") for s in f.get("datasources", ())]
    prometheus = [s for s in sources if s["type"] == "prometheus"]
    assert prometheus, sources
    url = urlparse(prometheus[0]["url"])
    assert url.hostname == "prometheus" and url.port in container_ports("prometheus")


def datasource_uids(node: Any) -> set[str]:
    """Every datasource uid a dashboard's panels, targets and variables name (`${var}` kept)."""
    found: set[str] = set()
    if isinstance(node, dict):
        source = node.get("datasource")
        if isinstance(source, dict) and isinstance(source.get("uid"), str):
            found.add(source["uid"])
        for value in node.values():
            found |= datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            found |= datasource_uids(value)
    return found - {"-- Grafana --", "grafana", "-- Mixed --"}


def unresolved_datasources(dashboard: dict[str, Any], sources: list[dict[str, Any]]) -> set[str]:
    """Datasource references that no provisioned datasource satisfies. A `${var}` reference
    resolves through a dashboard variable of type datasource whose query is a provisioned
    datasource type."""
    uids = {s.get("uid") for s in sources}
    types = {s["type"] for s in sources}
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", ())}
    unresolved = set()
    for uid in datasource_uids(dashboard):
        name = uid.removeprefix("$").strip("{}")
        if uid.startswith("$"):
            variable = variables.get(name, {})
            if variable.get("type") != "datasource" or variable.get("query") not in types:
                unresolved.add(uid)
        elif uid not in uids:
            unresolved.add(uid)
    return unresolved


def test_grafana_home_is_the_cost_dashboard_on_the_provisioned_datasource() -> None:
    grafana = compose()["services"]["grafana"]
    providers = [p for f in grafana_provisioning("dashboards") for p in f.get("providers", ())]
    dashboard_dirs = [host_path("grafana", p["options"]["path"]) for p in providers]
    assert dashboard_dirs and all(require_file(d).is_dir() for d in dashboard_dirs)

    home = host_path("grafana", grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert any(d in home.parents for d in dashboard_dirs), "home dashboard is not provisioned"
    dashboard = json.loads(require_file(home).read_text())
    assert "cost" in dashboard["title"].lower(), dashboard["title"]

    sources = [s for f in grafana_provisioning("datasources") for s in f["datasources"]]
    assert datasource_uids(dashboard), "the cost dashboard's panels name no datasource"
    for path in sorted(dashboard_dirs[0].glob("*.json")):
        missing = unresolved_datasources(json.loads(path.read_text()), sources)
        assert not missing, f"{path.name} uses datasources {missing} that are not provisioned"
