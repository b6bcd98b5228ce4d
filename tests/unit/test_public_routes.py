"""What answers without a key, with API keys configured: every route the app registers either
answers 401 without a key or is on PUBLIC, the list docs/metrics.md gives ("What answers
without a key"), so a new route cannot become public by accident. /metrics shows no series
with a `tenant` label unless the scrape sends --metrics-api-key, or comes to --metrics-port.

The app is built by create_app and driven in process (httpx over ASGI); the engine is never
started, so every protected route must refuse before it reaches the engine.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from engine.meter.config import MeterConfig
from engine.meter.cost_model import CostModel, ModelShape, WeightBytes
from engine.meter.energy import EnergyMeter
from engine.meter.meter import Meter
from engine.meter.peaks import Peaks
from engine.stats import KVCacheInfo
from server.app import create_app
from server.metering.prometheus_export import ServerMetrics
from server.routes.metrics import MetricsListener
from server.settings import Settings, SettingsError
from server.tenancy.keys_file import parse_tenants
from server.tenancy.tenants import TenantDirectory

try:  # FastAPI >= 0.120 keeps included routers nested; this walks them
    from fastapi.routing import iter_route_contexts
except ImportError:  # pragma: no cover - older FastAPI flattens app.routes itself
    iter_route_contexts = iter

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# What docs/metrics.md says answers without a key; test_the_docs_list_the_public_routes
# keeps the two equal.
PUBLIC = {
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/"),
    ("GET", "/console/config.json"),
    ("GET", "/console/{name}"),
}
KEYS_FILE = """
tenants:
  acme:
    keys: ["sk-acme"]
    price_per_million_input_tokens: 0.20
    price_per_million_output_tokens: 0.60
  beta:
    keys: ["sk-beta"]
"""
METRICS_KEY = "sk-metrics"
MODEL = "smollm2"


def _settings(keys: bool = True, **kwargs) -> Settings:
    specs = parse_tenants(KEYS_FILE, "keys.yaml") if keys else ()
    return Settings(tenants=TenantDirectory.build((), specs), **kwargs)


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    routes = set()
    for route in iter_route_contexts(app.routes):
        for method in route.methods or ():
            if method != "HEAD":
                routes.add((method, route.path))
    return sorted(routes)


def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _url(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "console.js", path)  # the only path parameter: a file name


ROUTES = _routes(create_app(_settings(metrics_api_key=METRICS_KEY)))


def test_the_walk_finds_every_router():
    paths = {path for _, path in ROUTES}
    assert {"/v1/chat/completions", "/v1/meterserve/live", "/openapi.json"} <= paths
    assert {path for _, path in PUBLIC} <= paths, "PUBLIC names a route the app lacks"


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
async def test_every_route_needs_a_key_unless_listed_public(method: str, path: str):
    app = create_app(_settings(metrics_api_key=METRICS_KEY))
    async with _client(app) as http:
        anonymous = await http.request(method, _url(path))
        wrong_key = await http.request(
            method, _url(path), headers={"Authorization": "Bearer sk-not-a-key"}
        )
    if (method, path) in PUBLIC:
        assert anonymous.status_code != 401, anonymous.text
        return
    for response in (anonymous, wrong_key):
        assert response.status_code == 401, (method, path, response.status_code, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_docs_list_the_public_routes():
    text = DOCS.read_text()
    section = text.split("## What answers without a key", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `(GET) (/[^`]*)`", section, flags=re.MULTILINE))
    assert listed == PUBLIC


async def test_no_swagger_or_redoc_and_the_schema_needs_the_key():
    app = create_app(_settings())
    async with _client(app) as http:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert (await http.get(path)).status_code == 404, path
        assert (await http.get("/openapi.json")).status_code == 401
        schema = (await http.get("/openapi.json", headers=_bearer("sk-beta"))).json()
    assert "/v1/chat/completions" in schema["paths"]
    assert "/openapi.json" not in schema["paths"] and "/docs" not in schema["paths"]


async def test_without_keys_the_schema_is_open_like_every_route():
    async with _client(create_app(_settings(keys=False))) as http:
        response = await http.get("/openapi.json")
    assert response.status_code == 200 and "/v1/completions" in response.json()["paths"]


async def test_the_model_list_answers_503_while_the_model_loads():
    async with _client(create_app(_settings(keys=False))) as http:  # the engine never starts
        response = await http.get(_url("/v1/models"))
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["error"]["code"] == "server_loading"


async def test_the_console_page_and_files_carry_the_csp():
    async with _client(create_app(_settings())) as http:
        for path in ("/", "/console/console.js", "/console/console.css", "/console/favicon.svg"):
            response = await http.get(path)
            assert response.status_code == 200, path
            csp = response.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
            assert "default-src 'none'" in csp and "base-uri 'none'" in csp, path
            assert response.headers["x-content-type-options"] == "nosniff", path


# ---- /metrics: the aggregate series for everyone, the tenant series for the metrics key ----


def _server_metrics() -> ServerMetrics:
    shape = ModelShape(
        num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
        intermediate_size=16, vocab_size=10, num_params=1272, dtype_bytes=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    weights = WeightBytes(
        body_small=300.0, body_large=1000.0, head_small=50.0, head_large=200.0,
        embedding_row=16.0, small_batch_rows=4,
    )  # fmt: skip
    meter = Meter(
        MeterConfig(), CostModel(shape, weights), Peaks(1e12, 2e10, "configured", "configured")
    )
    return ServerMetrics(
        meter,
        MODEL,
        KVCacheInfo(block_size=16, num_blocks=64, bytes_per_block=4096),
        shape.num_params,
        energy_meter=EnergyMeter([]),
        tenants=("acme", "beta", "default"),
    )


def _loaded(settings: Settings) -> FastAPI:
    app = create_app(settings)
    app.state.metrics = _server_metrics()  # what on_ready sets once the model has loaded
    return app


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _tenant_labels(text: str) -> set[str]:
    return {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "tenant" in sample.labels
    }


def _aggregate(text: str) -> bool:
    return f'meterserve_prompt_tokens_total{{model="{MODEL}"}} 0.0' in text


async def test_metrics_show_tenants_only_to_the_metrics_key():
    async with _client(_loaded(_settings(metrics_api_key=METRICS_KEY))) as http:
        anonymous = await http.get("/metrics")
        tenant = await http.get("/metrics", headers=_bearer("sk-acme"))
        wrong = await http.get("/metrics", headers=_bearer("sk-not-the-metrics-key"))
        full = await http.get("/metrics", headers=_bearer(METRICS_KEY))
    for response in (anonymous, tenant, wrong):
        assert response.status_code == 200
        assert "tenant=" not in response.text and "meterserve_tenant_" not in response.text
        assert _aggregate(response.text)
    assert full.status_code == 200 and _aggregate(full.text)
    assert _tenant_labels(full.text) == {"acme", "beta", "default"}
    assert anonymous.headers["vary"] == "Authorization"


async def test_with_keys_and_no_metrics_key_nobody_sees_tenants_on_the_main_port():
    async with _client(_loaded(_settings())) as http:
        for headers in ({}, _bearer("sk-acme")):
            response = await http.get("/metrics", headers=headers)
            assert response.status_code == 200 and _aggregate(response.text)
            assert "tenant=" not in response.text


async def test_without_keys_everything_stays_on_metrics():
    """A single tenant and no --metrics-api-key: today's exposition, tenant series included
    (tests/metrics and the Grafana dashboards read them)."""
    async with _client(_loaded(_settings(keys=False))) as http:
        response = await http.get("/metrics")
    assert _tenant_labels(response.text) == {"acme", "beta", "default"}
    # A metrics key hides them even then.
    async with _client(_loaded(_settings(keys=False, metrics_api_key=METRICS_KEY))) as http:
        assert "tenant=" not in (await http.get("/metrics")).text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_the_metrics_port_serves_everything_and_the_main_port_the_aggregates():
    port = _free_port()
    app = _loaded(_settings(metrics_port=port))
    app.state.engine_client.start = lambda: None  # no model: the lifespan's listener only
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(timeout=10) as http:
            listener = await http.get(f"http://127.0.0.1:{port}/metrics")
            assert (await http.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 404
        async with _client(app) as http:
            main = await http.get("/metrics")
    assert listener.status_code == 200 and _aggregate(listener.text)
    assert _tenant_labels(listener.text) == {"acme", "beta", "default"}
    assert "tenant=" not in main.text
    async with httpx.AsyncClient(timeout=2) as http:
        with pytest.raises(httpx.ConnectError):  # stopped with the app
            await http.get(f"http://127.0.0.1:{port}/metrics")


async def test_a_taken_metrics_port_fails_the_start_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listener = MetricsListener(_loaded(_settings()), "127.0.0.1", port)
        with pytest.raises(RuntimeError, match=f"--metrics-port: cannot listen on .*:{port}"):
            await listener.start()


def test_metrics_flags_and_their_environment_variables():
    settings = Settings.from_args(
        ["--metrics-api-key", "mk", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"],
        environ={},
    )
    assert (settings.metrics_api_key, settings.metrics_host, settings.metrics_port) == (
        "mk", "0.0.0.0", 9100,
    )  # fmt: skip
    settings = Settings.from_args(
        [], environ={"METERSERVE_METRICS_API_KEY": "mk", "METERSERVE_METRICS_PORT": "9100"}
    )
    assert (settings.metrics_api_key, settings.metrics_port) == ("mk", 9100)
    defaults = Settings.from_args([], environ={})
    assert (defaults.metrics_api_key, defaults.metrics_host, defaults.metrics_port) == (
        None, "127.0.0.1", None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-key", "k", "--metrics-api-key", "k"], "must not also be a tenant's API key"),
        (["--metrics-port", "8000"], "--metrics-port must differ from --port"),
        (["--metrics-port", "70000"], r"--metrics-port must be in 1\.\.65535"),
    ],
)
def test_bad_metrics_flags_are_refused(argv: list[str], message: str):
    with pytest.raises(SettingsError, match=message):
        Settings.from_args(argv, environ={})
