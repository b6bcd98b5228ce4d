"""Settings: everything `meterserve serve` is configured with, built once and frozen.

Every flag can also come from the environment as METERSERVE_<FLAG> (dashes to underscores,
upper case: --max-num-seqs -> METERSERVE_MAX_NUM_SEQS). A flag on the command line wins over
the environment, which wins over the default. Flag names follow vLLM's where vLLM has the
same knob (--dtype, --max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size,
--api-key, --served-model-name).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.meter.config import MeterConfig
from server.tenants import TenantDirectory, check_header_name
from server.tool_parsers import DEFAULT_PARSER, PARSER_NAMES

ENV_PREFIX = "METERSERVE_"

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
    "quantization",
    "num_threads",
    "debug_fault_token_id",
    "debug_hang_token_id",
    "debug_crash_token_id",
)


class SettingsError(ValueError):
    """A flag or environment variable has a bad value; the message names it."""


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
    # default, server/cache_salt.py).
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
                "with TenantDirectory.load(api_keys, ...)"
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
            engine = EngineConfig(**{name: getattr(ns, name) for name in _ENGINE_FIELDS})
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
        return TenantDirectory.load(
            api_keys,
            ns.api_keys_file or None,
            tenant_header=header,
            max_tenant_labels=ns.max_tenant_labels,
        )
    except ValueError as exc:
        raise SettingsError(f"--api-keys-file: {exc}") from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meterserve serve",
        description="Serve a model over an OpenAI-compatible HTTP API. "
        f"Every flag may also be set as an environment variable {ENV_PREFIX}<FLAG>.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct "
        "GGUF), a Hugging Face model directory, or a .gguf file",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients use")
    p.add_argument(
        "--tool-call-parser",
        choices=PARSER_NAMES,
        default=DEFAULT_PARSER,
        help="the format tool calls are parsed from and forced into (vLLM's names); auto "
        "picks it from the chat template",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice auto is always on",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' (repeat for several keys; "
        "the environment variable takes a comma-separated list)",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="YAML or JSON file of tenants, their keys and price plans (see server/tenants.py)",
    )
    p.add_argument(
        "--tenant-header",
        default=None,
        metavar="NAME",
        help="trust this header to name the tenant; only behind a gateway that sets it",
    )
    p.add_argument(
        "--max-tenant-labels",
        type=int,
        default=100,
        help="tenants (in file order) with their own metric label; the rest are 'other'",
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128, help="cap on the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="most prompt tokens one request computes in a step; unset: half the step budget "
        "(a long prompt leaves room to admit others'); 0: the whole budget",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--kv-cache-bytes",
        type=parse_bytes,
        default=None,
        help="KV-cache budget, e.g. 512MiB (wins over the fraction)",
    )
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.1,
        help="KV-cache budget as a fraction of available memory",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument(
        "--attention-backend",
        choices=["auto", "reference", "batched", "cpu_kernels"],
        default="auto",
    )
    p.add_argument(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="native C++ kernels for decode (built on first use; falls back to plain torch)",
    )
    p.add_argument(
        "--gguf-matvec",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GGUF models: linear layers read the file's quantized blocks at every batch size "
        "(--no-gguf-matvec: dequantize them to bf16 once at load)",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "int8"],
        default="none",
        help="int8: quantize a bf16/fp16 checkpoint's linears at load (weights per channel)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="queued requests (no first token yet) beyond which requests get 429",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=262_144,
        help="queued prompt tokens beyond which requests get 429",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take in total; 0 disables",
    )
    p.add_argument(
        "--drain-grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=60.0,
        help="/health answers 503 (liveness) when requests are pending and the engine has not "
        "finished a step for this many seconds; 0 disables",
    )
    p.add_argument("--max-request-body-bytes", type=parse_bytes, default=4 * 2**20)
    p.add_argument(
        "--max-choices-per-request",
        type=int,
        default=64,
        help="engine requests (prompts x n) one API request may ask for; more is a 400",
    )
    p.add_argument(
        "--shared-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let tenants hit each other's prefix-cache blocks (each then learns how others' "
        "prompts begin); off: a tenant hits only its own",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False)
    _add_meter_flags(p)
    _add_metrics_flags(p)
    # Testing aids: a step containing this token id fails / hangs (30 s) / kills the engine
    # thread, inside the model runner. Command line only (apply_env_defaults skips them), so a
    # stray METERSERVE_DEBUG_* variable in a deployment cannot hand any client a kill switch.
    p.add_argument("--debug-fault-token-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--debug-hang-token-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--debug-crash-token-id", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _add_meter_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("meter", "prices, hardware peaks and latency objectives")
    g.add_argument(
        "--hardware-price-per-hour",
        type=float,
        default=None,
        help="USD per hour of this replica's hardware",
    )
    g.add_argument("--price-per-million-input-tokens", type=float, default=None)
    g.add_argument("--price-per-million-output-tokens", type=float, default=None)
    g.add_argument("--cost-ceiling-per-million-output-tokens", type=float, default=None)
    g.add_argument("--peak-flops", type=float, default=None, help="FLOP/s; unset = measured")
    g.add_argument(
        "--peak-memory-bandwidth", type=float, default=None, help="bytes/s; unset = measured"
    )
    g.add_argument("--slo-ttft", type=float, default=None, help="seconds to first token")
    g.add_argument("--slo-itl", type=float, default=None, help="seconds between tokens")


def _add_metrics_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "metrics access", "who sees the per-tenant series of /metrics (docs/metrics.md)"
    )
    g.add_argument(
        "--metrics-api-key",
        default=None,
        metavar="KEY",
        help="/metrics shows its per-tenant series only to 'Authorization: Bearer KEY'; "
        "other scrapes get the aggregate series",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the full /metrics, per-tenant series included, on this port",
    )
    g.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port")


_COMMAND_LINE_ONLY = "debug_"  # flags no environment variable sets (the testing aids)


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Turn METERSERVE_<FLAG> variables into parser defaults (so the command line still wins)."""
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.dest.startswith(_COMMAND_LINE_ONLY):
            continue
        name = ENV_PREFIX + action.dest.upper()
        if name not in environ:
            continue
        defaults[action.dest] = _env_value(action, name, environ[name])
    parser.set_defaults(**defaults)


def _env_value(action: argparse.Action, name: str, raw: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction):
        return parse_bool(raw, name)
    if isinstance(action, argparse._AppendAction):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if raw == "" and action.default is None:
        return None
    try:
        value = action.type(raw) if action.type else raw
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name}={raw!r}: {exc}") from exc
    if action.choices is not None and value not in action.choices:
        raise SettingsError(f"{name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value


def parse_bool(raw: str, name: str = "value") -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r}: expected true/false")


_BYTE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_bytes(raw: str) -> int:
    """'4096', '512MiB', '2G', '1.5GiB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", raw.lower())
    if match is None:
        raise ValueError(f"not a byte size: {raw!r} (examples: 4096, 512MiB, 2G)")
    number, unit = match.groups()
    return int(float(number) * _BYTE_UNITS[unit or ""])


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)
