"""Settings: everything `meterserve serve` is configured with, built once and frozen from
the parsed flags (server/cli_flags.py: the parser and the METERSERVE_<FLAG> environment)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.meter.config import MeterConfig
from scheduler.speculative_config import SpeculativeConfig
from server.cli_flags import SettingsError, apply_env_defaults, build_parser
from server.tenancy.keys_file import load_tenant_directory
from server.tenancy.tenants import TenantDirectory, check_header_name

# Meter flag dest -> MeterConfig field; unset flags keep MeterConfig's own defaults.
_METER_FIELDS = {
    "hardware_price_per_hour": "hardware_price_per_hour",
    "price_per_million_input_tokens": "price_per_million_input_tokens",
    "price_per_million_output_tokens": "price_per_million_output_tokens",
    "peak_flops": "peak_flops",
    "peak_memory_bandwidth": "peak_memory_bandwidth",
    "slo_ttft": "slo_ttft_seconds",
    "slo_itl": "slo_itl_seconds",
    "cost_ceiling_per_million_output_tokens": "cost_ceiling_per_million_output_tokens",
}

_ENGINE_FIELDS = (
    "model",
    "dtype",
    "max_model_len",
    "block_size",
    "kv_cache_bytes",
    "kv_cache_memory_fraction",
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "enable_prefix_caching",
    "scheduling_policy",
    "attention_backend",
    "cpu_kernels",
    "gguf_matvec",
    "gguf_large_batch",
    "gguf_activations",
    "quantization",
    "batch_invariant",
    "num_threads",
    "debug_fault_token_id",
    "debug_hang_token_id",
    "debug_crash_token_id",
)


@dataclass(frozen=True, slots=True)
class Settings:
    """The HTTP edge's own knobs plus the engine's and the meter's frozen configs."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # the plain --api-key keys; all keys live in `tenants`
    tenants: TenantDirectory = field(default_factory=TenantDirectory)  # no keys = no auth
    served_model_name: str | None = None  # None = the model's own name
    # How the model writes tool calls (server/tool_parsers): a format's name, or auto (picked
    # from the chat template).
    tool_call_parser: str = "hermes"
    max_waiting_requests: int = 256  # engine requests accepted but without a first token yet
    max_queued_tokens: int = 262_144  # prompt tokens of those requests
    request_timeout: float | None = 600.0  # seconds from arrival to the last token; None = none
    drain_grace_period: float = 30.0  # seconds in-flight requests get after SIGTERM
    # /health turns 503 when requests are pending and the engine thread has not finished a
    # step for this many seconds (a wedged native call, a deadlock); None = never.
    engine_stall_timeout: float | None = 60.0
    max_request_body_bytes: int = 4 * 2**20
    max_choices_per_request: int = 64  # engine requests (prompts x n) one API request may ask
    # Tenants share prefix-cache blocks (each can learn how others' prompts begin: off by
    # default, server/tenancy/cache_salt.py).
    shared_prefix_cache: bool = False
    log_level: str = "info"
    access_log: bool = False
    # Per-tenant metric series (who pays what): with keys configured, /metrics shows them only
    # to a scrape with this key; --metrics-port serves them on a listener of their own.
    metrics_api_key: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None = no separate listener
    engine: EngineConfig = field(default_factory=EngineConfig)
    meter: MeterConfig = field(default_factory=MeterConfig)

    def __post_init__(self) -> None:
        # Auth reads `tenants` only: a Settings built by hand with api_keys but without them
        # in `tenants` would silently serve unauthenticated, so refuse it.
        if any(self.tenants.resolve(key) is None for key in self.api_keys):
            raise SettingsError(
                "Settings.api_keys holds keys that Settings.tenants does not: build tenants "
                "with load_tenant_directory(api_keys, ...) (server/tenancy/keys_file.py)"
            )
        # A tenant holding the metrics key would read every other tenant's bill.
        key = self.metrics_api_key
        if key is not None and self.tenants.resolve(key) is not None:
            raise SettingsError("--metrics-api-key must not also be a tenant's API key")

    @classmethod
    def from_args(cls, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
        parser = build_parser()
        apply_env_defaults(parser, os.environ if environ is None else environ)
        return cls.from_namespace(parser.parse_args(list(argv)))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> Settings:
        try:
            engine = EngineConfig(
                **{name: getattr(ns, name) for name in _ENGINE_FIELDS},
                speculative=_speculative(ns.speculative_config),
                keep_freed_memory=True,  # a server's steps reuse memory (engine/freed_memory.py)
            )
            meter_kwargs = {
                target: getattr(ns, dest)
                for dest, target in _METER_FIELDS.items()
                if getattr(ns, dest) is not None
            }
            meter = MeterConfig(**meter_kwargs)
        except ValueError as exc:
            raise SettingsError(str(exc)) from exc
        _require(ns.port >= 0, "--port must be >= 0")
        _require(ns.max_waiting_requests >= 1, "--max-waiting-requests must be >= 1")
        _require(ns.max_queued_tokens >= 1, "--max-queued-tokens must be >= 1")
        _require(ns.drain_grace_period >= 0, "--drain-grace-period must be >= 0")
        _require(ns.engine_stall_timeout >= 0, "--engine-stall-timeout must be >= 0")
        _require(ns.max_request_body_bytes >= 1024, "--max-request-body-bytes must be >= 1024")
        _require(ns.max_choices_per_request >= 1, "--max-choices-per-request must be >= 1")
        api_keys = tuple(key for key in ns.api_key or () if key)
        return cls(
            host=ns.host,
            port=ns.port,
            api_keys=api_keys,
            tenants=_tenants(ns, api_keys),
            served_model_name=ns.served_model_name,
            tool_call_parser=ns.tool_call_parser,
            max_waiting_requests=ns.max_waiting_requests,
            max_queued_tokens=ns.max_queued_tokens,
            request_timeout=ns.request_timeout if ns.request_timeout else None,
            drain_grace_period=ns.drain_grace_period,
            engine_stall_timeout=ns.engine_stall_timeout if ns.engine_stall_timeout else None,
            max_request_body_bytes=ns.max_request_body_bytes,
            max_choices_per_request=ns.max_choices_per_request,
            shared_prefix_cache=ns.shared_prefix_cache,
            log_level=ns.log_level,
            access_log=ns.access_log,
            **_metrics_access(ns),
            engine=engine,
            meter=meter,
        )


def _speculative(text: str | None) -> SpeculativeConfig | None:
    return None if not text else SpeculativeConfig.from_json(text)


def _metrics_access(ns: argparse.Namespace) -> dict[str, Any]:
    """The metrics flags; __post_init__ checks that no tenant holds the metrics key."""
    key = ns.metrics_api_key or None
    port = ns.metrics_port or None
    if port is not None:
        _require(1 <= port <= 65535, "--metrics-port must be in 1..65535")
        _require(port != ns.port, "--metrics-port must differ from --port")
    return {"metrics_api_key": key, "metrics_host": ns.metrics_host, "metrics_port": port}


def _tenants(ns: argparse.Namespace, api_keys: tuple[str, ...]) -> TenantDirectory:
    """The keys file is read here, once; its errors name the flag and the file."""
    _require(ns.max_tenant_labels >= 1, "--max-tenant-labels must be >= 1")
    header = ns.tenant_header or None
    if header is not None:
        try:
            check_header_name(header)
        except ValueError as exc:
            raise SettingsError(f"--tenant-header: {exc}") from exc
    try:
        return load_tenant_directory(
            api_keys,
            ns.api_keys_file or None,
            tenant_header=header,
            max_tenant_labels=ns.max_tenant_labels,
        )
    except ValueError as exc:
        raise SettingsError(f"--api-keys-file: {exc}") from exc


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)
