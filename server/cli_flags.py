"""The command line of `meterserve serve`: every flag, and METERSERVE_<FLAG> environment
variables as their defaults.

Every flag can also come from the environment as METERSERVE_<FLAG> (dashes to underscores,
upper case: --max-num-seqs -> METERSERVE_MAX_NUM_SEQS). A flag on the command line wins over
the environment, which wins over the default. Flag names follow vLLM's where vLLM has the
same knob (--dtype, --max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size,
--api-key, --served-model-name). server/settings.py turns the parsed flags into Settings.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any

from server.tool_parsers import DEFAULT_PARSER, PARSER_NAMES

ENV_PREFIX = "METERSERVE_"


class SettingsError(ValueError):
    """A flag or environment variable has a bad value; the message names it."""


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
        help="YAML or JSON file of tenants, their keys and price plans "
        "(see server/tenancy/keys_file.py)",
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
        choices=["auto", "reference", "batched", "cpu_kernels", "avx2"],
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
        "--gguf-large-batch",
        choices=["auto", "bf16", "blocks"],
        default="auto",
        help="GGUF models, passes of more than 4 rows (64 on an AMX CPU): bf16 keeps a bf16 copy "
        "of the weights for them; blocks reads the file's blocks (one copy in memory); auto: "
        "blocks on an AMX CPU (as fast there); elsewhere bf16 (faster there) while the copy "
        "fits in half the available memory, else blocks",
    )
    p.add_argument(
        "--gguf-activations",
        choices=["exact", "int8"],
        default="exact",
        help="GGUF models, passes of 1-8 rows (decode): int8 quantizes their inputs to int8 and "
        "multiplies the stored codes by them in integers, as llama.cpp does (faster, inputs "
        "rounded); exact multiplies the file's exact weights",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "int8", "int4"],
        default="none",
        help="quantize a bf16/fp16 checkpoint's linears at load: int8 (weights per channel, "
        "activations per token, smoothed), int4 (weight-only Q4_1 blocks of 32)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens do not depend on what shares its batch (one arithmetic per "
        "row on every kernel path; slower, see docs/benchmarks.md)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding, vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
        "\"prompt_lookup_min\": 2}' (n-gram drafts from the request's own tokens) or "
        '\'{"model": PATH, "num_speculative_tokens": 3}\' (drafts from a smaller model '
        "sharing the tokenizer)",
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
