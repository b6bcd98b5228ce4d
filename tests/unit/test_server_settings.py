"""Settings from flags and METERSERVE_* variables; the CLI's dispatch; API-key matching."""

from __future__ import annotations

import pytest

from engine.meter.config import MeterConfig
from server.cli import main
from server.cli_flags import parse_bytes
from server.settings import Settings, SettingsError
from server.tenancy.auth import key_matches
from server.tenancy.keys_file import load_tenant_directory
from server.tenancy.tenants import PricePlan, Tenant


def test_defaults():
    settings = Settings.from_args([], environ={})
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.api_keys == ()
    assert settings.engine.model == "default" and settings.engine.enable_prefix_caching
    assert settings.engine.keep_freed_memory  # a server's steps reuse freed memory
    assert settings.meter == MeterConfig()


def test_vllm_style_flags_build_engine_and_meter_configs():
    settings = Settings.from_args(
        [
            "--model", "/models/x", "--port", "9001", "--dtype", "float32",
            "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
            "--block-size", "32", "--kv-cache-bytes", "512MiB", "--no-enable-prefix-caching",
            "--api-key", "a", "--api-key", "b", "--served-model-name", "smol",
            "--max-waiting-requests", "7", "--max-queued-tokens", "999",
            "--request-timeout", "0", "--drain-grace-period", "3",
            "--hardware-price-per-hour", "2.5", "--peak-flops", "1e12", "--slo-ttft", "0.5",
            "--slo-itl", "0.05", "--debug-fault-token-id", "13", "--batch-invariant",
        ],
        environ={},
    )  # fmt: skip
    engine = settings.engine
    assert engine.model == "/models/x" and engine.dtype == "float32"
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (
        4096, 8, 512,
    )  # fmt: skip
    assert engine.block_size == 32 and engine.kv_cache_bytes == 512 * 2**20
    assert not engine.enable_prefix_caching and engine.debug_fault_token_id == 13
    assert engine.batch_invariant and not Settings.from_args([], environ={}).engine.batch_invariant
    assert settings.api_keys == ("a", "b") and settings.served_model_name == "smol"
    assert (settings.max_waiting_requests, settings.max_queued_tokens) == (7, 999)
    assert settings.request_timeout is None and settings.drain_grace_period == 3
    meter = settings.meter
    assert meter.hardware_price_per_hour == 2.5 and meter.peak_flops == 1e12
    assert (meter.slo_ttft_seconds, meter.slo_itl_seconds) == (0.5, 0.05)
    assert meter.price_per_million_input_tokens == MeterConfig().price_per_million_input_tokens


def test_environment_and_command_line_precedence():
    env = {
        "METERSERVE_PORT": "7000",
        "METERSERVE_MAX_NUM_SEQS": "4",
        "METERSERVE_ENABLE_PREFIX_CACHING": "false",
        "METERSERVE_API_KEY": "k1, k2",
        "METERSERVE_KV_CACHE_BYTES": "1GiB",
        "METERSERVE_HARDWARE_PRICE_PER_HOUR": "1.25",
        "UNRELATED": "x",
    }
    settings = Settings.from_args(["--max-num-seqs", "16"], environ=env)
    assert settings.port == 7000  # from the environment
    assert settings.engine.max_num_seqs == 16  # the command line wins
    assert not settings.engine.enable_prefix_caching
    assert settings.api_keys == ("k1", "k2")
    assert settings.engine.kv_cache_bytes == 2**30
    assert settings.meter.hardware_price_per_hour == 1.25


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"METERSERVE_PORT": "eighty"}, "METERSERVE_PORT"),
        ({"METERSERVE_DTYPE": "int3"}, "METERSERVE_DTYPE"),
        ({"METERSERVE_ENABLE_PREFIX_CACHING": "maybe"}, "METERSERVE_ENABLE_PREFIX_CACHING"),
        ({"METERSERVE_BLOCK_SIZE": "12"}, "power of two"),
        ({"METERSERVE_HARDWARE_PRICE_PER_HOUR": "-1"}, "hardware_price_per_hour"),
        ({"METERSERVE_MAX_WAITING_REQUESTS": "0"}, "--max-waiting-requests"),
    ],
)
def test_bad_values_name_their_source(env, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_args([], environ=env)


def test_parse_bytes():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2G") == 2 * 10**9
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_cli_usage_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert main([]) == 2
    assert main(["serve", "--port", "-1"]) == 2


def test_api_key_matching():
    assert key_matches("secret", ("other", "secret"))
    assert not key_matches("secre", ("secret",))
    assert not key_matches("", ("secret",))
    assert not key_matches("secret", ())
    assert key_matches("ключ", ("ключ",))


# --- tenants: --api-keys-file, --tenant-header, --max-tenant-labels ---

KEYS_FILE = """
tenants:
  acme:
    keys: ["sk-acme"]
    price_per_million_input_tokens: 0.2
    price_per_million_output_tokens: 0.6
  beta:
    keys: ["sk-beta"]
"""


def test_tenant_defaults_and_plain_keys():
    assert not Settings.from_args([], environ={}).tenants.requires_auth
    settings = Settings.from_args(["--api-key", "a"], environ={})
    tenants = settings.tenants
    assert tenants.requires_auth and tenants.tenant_header is None
    assert tenants.max_tenant_labels == 100 and tenants.tenant_names == ()
    assert tenants.resolve("a") == Tenant("default", None)


def test_tenant_flags(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_FILE)
    settings = Settings.from_args(
        ["--api-key", "plain", "--api-keys-file", str(path), "--tenant-header", "X-Tenant",
         "--max-tenant-labels", "1"],
        environ={},
    )  # fmt: skip
    tenants = settings.tenants
    assert settings.api_keys == ("plain",)
    assert tenants.resolve("plain") == Tenant("default", None)
    assert tenants.resolve("sk-acme") == Tenant("acme", PricePlan(0.2, 0.6))
    assert tenants.tenant_header == "x-tenant" and tenants.max_tenant_labels == 1
    assert (tenants.label("acme"), tenants.label("beta")) == ("acme", "other")


def test_tenant_flags_from_the_environment(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"tenants": {"beta": {"keys": ["sk-beta"]}}}')
    env = {
        "METERSERVE_API_KEYS_FILE": str(path),
        "METERSERVE_TENANT_HEADER": "x-org",
        "METERSERVE_MAX_TENANT_LABELS": "5",
    }
    tenants = Settings.from_args([], environ=env).tenants
    assert tenants.resolve("sk-beta") == Tenant("beta", None)
    assert (tenants.tenant_header, tenants.max_tenant_labels) == ("x-org", 5)


@pytest.mark.parametrize(
    ("contents", "args", "message"),
    [
        ("tenants: {acme: {keys: ['']}}", [], "--api-keys-file: .*keys.yaml: tenant 'acme'"),
        ("tenants: {beta: {keys: [sk-a]}}", ["--api-key", "sk-a"], "--api-keys-file: .*--api-key"),
        (None, [], "--api-keys-file: .*keys.yaml: cannot read"),
        (KEYS_FILE, ["--max-tenant-labels", "0"], "--max-tenant-labels must be >= 1"),
        (KEYS_FILE, ["--tenant-header", "x tenant"], "--tenant-header: not an HTTP header name"),
        (KEYS_FILE, ["--tenant-header", "Authorization"], "--tenant-header: .*Authorization"),
    ],
)
def test_bad_tenant_flags(tmp_path, contents, args, message):
    path = tmp_path / "keys.yaml"
    if contents is not None:
        path.write_text(contents)
    with pytest.raises(SettingsError, match=message):
        Settings.from_args(["--api-keys-file", str(path), *args], environ={})


def test_settings_built_by_hand_must_carry_their_keys_in_tenants():
    with pytest.raises(SettingsError, match="tenants"):
        Settings(api_keys=("k",))
    tenants = load_tenant_directory(("k",))
    assert Settings(api_keys=("k",), tenants=tenants).tenants.requires_auth


# --- liveness: --engine-stall-timeout; the hidden fault-injection flags ---


def test_engine_stall_timeout():
    assert Settings.from_args([], environ={}).engine_stall_timeout == 60.0
    assert Settings().engine_stall_timeout == 60.0
    flag = Settings.from_args(["--engine-stall-timeout", "2.5"], environ={})
    assert flag.engine_stall_timeout == 2.5
    env = {"METERSERVE_ENGINE_STALL_TIMEOUT": "7"}
    assert Settings.from_args([], environ=env).engine_stall_timeout == 7.0
    disabled = Settings.from_args(["--engine-stall-timeout", "0"], environ={})
    assert disabled.engine_stall_timeout is None
    with pytest.raises(SettingsError, match="--engine-stall-timeout must be >= 0"):
        Settings.from_args(["--engine-stall-timeout", "-1"], environ={})


def test_debug_hang_and_crash_flags_are_hidden_engine_fields(capsys):
    engine = Settings.from_args(
        ["--debug-hang-token-id", "14", "--debug-crash-token-id", "15"], environ={}
    ).engine
    assert (engine.debug_hang_token_id, engine.debug_crash_token_id) == (14, 15)
    defaults = Settings.from_args([], environ={}).engine
    assert (defaults.debug_hang_token_id, defaults.debug_crash_token_id) == (None, None)
    with pytest.raises(SystemExit):
        Settings.from_args(["--help"], environ={})
    help_text = capsys.readouterr().out
    assert "--engine-stall-timeout" in help_text and "--debug-hang" not in help_text
