"""deploy/k8s: every kustomization renders, validates, and its parts point at each other.

Core kinds are validated with kubernetes-validate --strict (bundled upstream schemas). The CRD
kinds (ScaledObject, ServiceMonitor, InferencePool) are validated against their published
openAPIV3Schema, vendored and trimmed in tests/deploy/schemas/ (each file names its source).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_support import KUSTOMIZATIONS, find, only, render, settings_env_names

SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        "inferencepool.inference.networking.k8s.io_v1.yaml"
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.keda.sh_v1alpha1.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.monitoring.coreos.com_v1.yaml",
}
# The oldest Kubernetes we claim (gRPC probes GA in 1.27; InferencePool v1 needs >= 1.29 for its
# CEL rules) and the newest the validator ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

# Gauges the endpoint picker and the autoscalers read; server/metering/prometheus_export.py
# must export them.
WAITING = "meterserve_num_requests_waiting"
RUNNING = "meterserve_num_requests_running"
KV_USAGE = "meterserve_kv_cache_usage_ratio"
CACHE_INFO = "meterserve_cache_config_info"


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Schema violations of one CRD-kind document, plus the CEL rules that matter to us."""
    schema = yaml.safe_load((SCHEMAS / CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]).read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]
    if doc["kind"] == "InferencePool" and not errors:
        ref = doc["spec"]["endpointPickerRef"]
        # x-kubernetes-validations: self.kind != 'Service' || has(self.port)
        if ref.get("kind", "Service") == "Service" and "port" not in ref:
            errors.append("spec/endpointPickerRef: port is required when kind is 'Service'")
        numbers = [p["number"] for p in doc["spec"]["targetPorts"]]
        if len(numbers) != len(set(numbers)):
            errors.append("spec/targetPorts: port number must be unique")
    return errors


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found


def container_port(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    return number


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_into_one_namespace(kustomization: str) -> None:
    docs = render(kustomization)
    assert only(docs, "Deployment", "meterserve")
    assert only(docs, "Service", "meterserve")
    for doc in docs:
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "meterserve", doc["metadata"]["name"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_core_kinds_validate_strict(kustomization: str, version: str) -> None:
    not_core = set()
    for doc in render(kustomization):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            not_core.add((doc["apiVersion"], doc["kind"]))
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {exc}")
    # A misspelt core apiVersion would also land here; only the CRD kinds we check may.
    assert not_core <= set(CRD_SCHEMAS), not_core - set(CRD_SCHEMAS)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_crd_kinds_match_published_schemas(kustomization: str) -> None:
    for doc in render(kustomization):
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
            assert crd_errors(doc) == [], f"{doc['kind']}/{doc['metadata']['name']}"


def test_crd_schemas_reject_what_the_api_server_would() -> None:
    """The vendored schemas are not vacuous: each rejects a typical mistake."""
    docs = render("")
    scaled = only(docs, "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # must be the string "4"
    assert any("threshold" in e for e in crd_errors(scaled))

    monitor = only(docs, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert any("intervall" in e for e in crd_errors(monitor))

    pool = only(docs, "InferencePool")
    del pool["spec"]["endpointPickerRef"]["port"]
    assert crd_errors(pool) == ["spec/endpointPickerRef: port is required when kind is 'Service'"]
    del pool["spec"]["targetPorts"]
    assert any("targetPorts" in e for e in crd_errors(pool))


def test_model_server_probes_and_graceful_termination() -> None:
    docs = render("")
    deployment = only(docs, "Deployment", "meterserve")
    pod = deployment["spec"]["template"]["spec"]
    server = container(deployment, "meterserve")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = server[probe]["httpGet"]
        assert get["path"] == "/health"
        assert container_port(server, get["port"]) == 8000
    assert server["resources"]["requests"]["cpu"] and server["resources"]["limits"]["memory"]

    config = only(docs, "ConfigMap", "meterserve-config")["data"]
    drain = float(config["METERSERVE_DRAIN_GRACE_PERIOD"])
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sleep"
    pre_stop = float(command[1])
    # SIGTERM arrives after preStop; the kubelet SIGKILLs at the grace period.
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain
    # /health is 503 while draining: liveness must tolerate a whole drain.
    live = server["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > drain
    # The EPP outlives the replicas it routes to.
    epp = only(docs, "Deployment", "meterserve-epp")["spec"]["template"]["spec"]
    assert epp["terminationGracePeriodSeconds"] >= pod["terminationGracePeriodSeconds"]


def test_every_meterserve_env_var_is_a_real_flag_and_parses() -> None:
    from server.settings import Settings

    for kustomization in KUSTOMIZATIONS:
        docs = render(kustomization)
        config = only(docs, "ConfigMap", "meterserve-config")["data"]
        server = container(only(docs, "Deployment", "meterserve"), "meterserve")
        names = set(config) | {e["name"] for e in server.get("env", ())}
        assert names <= settings_env_names(), names - settings_env_names()
        # The ConfigMap's values are accepted by the real settings parser.
        settings = Settings.from_args([], environ=config)
        assert settings.drain_grace_period == float(config["METERSERVE_DRAIN_GRACE_PERIOD"])


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_model_server_is_guaranteed_qos_on_whole_cores(kustomization: str) -> None:
    """CPU request = limit in whole cores (and memory request = limit): Guaranteed QoS, which the
    kubelet's static CPU manager needs to pin the container to exclusive cores."""
    deployment = only(render(kustomization), "Deployment", "meterserve")
    resources = container(deployment, "meterserve")["resources"]
    requests, limits = resources["requests"], resources["limits"]
    assert requests.get("cpu") and requests["cpu"] == limits.get("cpu"), resources
    assert str(requests["cpu"]).isdigit() and int(requests["cpu"]) >= 1, requests["cpu"]
    assert requests.get("memory") and requests["memory"] == limits.get("memory"), resources


def test_selectors_ports_and_references_line_up() -> None:
    docs = render("")
    deployment = only(docs, "Deployment", "meterserve")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    server = container(deployment, "meterserve")

    service = only(docs, "Service", "meterserve")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (http,) = service["spec"]["ports"]
    assert container_port(server, http["targetPort"]) == 8000

    monitor = only(docs, "ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [http["name"]]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"

    pool = only(docs, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    epp_service = only(docs, "Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp = only(docs, "Deployment", ref["name"])
    assert (
        epp_service["spec"]["selector"].items()
        <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    binding = only(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]


def test_endpoint_picker_reads_meterserve_metrics() -> None:
    docs = render("")
    epp = container(only(docs, "Deployment", "meterserve-epp"), "epp")
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in epp["args"])
    assert flags["pool-name"] == only(docs, "InferencePool")["metadata"]["name"]
    assert flags["total-queued-requests-metric"] == WAITING
    assert flags["total-running-requests-metric"] == RUNNING
    assert flags["kv-cache-usage-percentage-metric"] == KV_USAGE
    assert flags["cache-info-metric"] == CACHE_INFO
    assert flags["lora-info-metric"] == ""  # no LoRA: scraping it would only log errors
    config_file = flags["config-file"]
    (mount,) = epp["volumeMounts"]
    plugins = only(docs, "ConfigMap", "meterserve-epp")["data"][Path(config_file).name]
    assert Path(config_file).parent == Path(mount["mountPath"])
    plugin_types = {p["type"] for p in yaml.safe_load(plugins)["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= plugin_types


def test_autoscalers_scale_the_deployment_on_waiting_requests_and_never_both() -> None:
    for kustomization in KUSTOMIZATIONS:
        docs = render(kustomization)
        scalers = find(docs, "ScaledObject") + find(docs, "HorizontalPodAutoscaler")
        assert len(scalers) <= 1, f"{kustomization}: KEDA and an HPA would fight over replicas"
    scaled = only(render(""), "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "meterserve",
    }
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert WAITING in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) > 0

    hpa = only(render("overlays/hpa"), "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "meterserve"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == WAITING
    assert metric["pods"]["target"]["averageValue"] == trigger["metadata"]["threshold"]


def test_model_pvc_overlay_mounts_the_claim_read_only() -> None:
    docs = render("overlays/model-pvc")
    claim = only(docs, "PersistentVolumeClaim")
    deployment = only(docs, "Deployment", "meterserve")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    server = container(deployment, "meterserve")
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == "models"]
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert mount["readOnly"] is True
    model = {e["name"]: e.get("value") for e in server["env"]}["METERSERVE_MODEL"]
    assert model.startswith(mount["mountPath"] + "/")
    # The patch adds to the base container; it must not drop the base's probes or scratch volumes.
    assert server["readinessProbe"] and {"tmp", "home", "dshm"} <= set(volumes)
    assert "PersistentVolumeClaim" not in {d["kind"] for d in render("")}


def test_real_exporter_serves_the_metrics_the_picker_and_autoscalers_read() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from engine.meter.config import MeterConfig
    from engine.meter.cost_model import CostModel, ModelShape
    from engine.meter.energy import EnergyMeter
    from engine.meter.meter import Meter
    from engine.meter.peaks import Peaks
    from engine.stats import KVCacheInfo
    from server.metering.prometheus_export import ServerMetrics

    shape = ModelShape(
        num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, num_params=135_000_000, dtype_bytes=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    meter = Meter(MeterConfig(), CostModel(shape), Peaks(1e12, 1e11, "configured", "configured"))
    metrics = ServerMetrics(
        meter,
        "smollm2",
        KVCacheInfo(block_size=16, num_blocks=128, bytes_per_block=4096),
        num_params=135_000_000,
        energy_meter=EnergyMeter.detect(Path("/nonexistent")),
    )
    metrics.set_queue_state(num_waiting=3, num_running=2, kv_cache_usage=0.25)
    body, _ = metrics.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    values = {name: families[name].samples[0] for name in (WAITING, RUNNING, KV_USAGE, CACHE_INFO)}
    assert all(families[name].type == "gauge" for name in values)
    assert values[WAITING].value == 3 and values[RUNNING].value == 2
    assert values[KV_USAGE].value == 0.25
    info = values[CACHE_INFO]
    assert (
        info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_blocks"] == "128"
    )
