"""Tenants: the keys file (YAML and JSON) and its validation, constant-time key resolution,
bounded metric labels, and the tenant each request gets from require_api_key."""

from __future__ import annotations

import hmac
import json
from types import SimpleNamespace

import pytest
from starlette.datastructures import Headers
from starlette.requests import Request

from server.http.errors import OpenAIError
from server.settings import Settings
from server.tenancy.auth import require_api_key, tenant_for
from server.tenancy.keys_file import load_tenant_directory, parse_tenants, read_tenants_file
from server.tenancy.tenants import (
    DEFAULT_TENANT,
    PricePlan,
    Tenant,
    TenantDirectory,
    TenantSpec,
)

YAML = """
tenants:
  acme:
    keys: ["sk-acme-1", "sk-acme-2"]
    price_per_million_input_tokens: 0.20   # optional, both or neither
    price_per_million_output_tokens: 0.60
  beta:
    keys: ["sk-beta"]
"""
ACME = Tenant("acme", PricePlan(0.2, 0.6))
BETA = Tenant("beta", None)


def directory(text: str = YAML, api_keys=(), **kwargs) -> TenantDirectory:
    return TenantDirectory.build(api_keys, parse_tenants(text, "keys.yaml"), **kwargs)


def test_yaml_file_in_file_order(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(YAML)
    assert read_tenants_file(path) == (
        TenantSpec(ACME, ("sk-acme-1", "sk-acme-2")),
        TenantSpec(BETA, ("sk-beta",)),
    )


def test_json_by_extension_and_by_content(tmp_path):
    document = {
        "tenants": {
            "acme": {
                "keys": ["sk-acme-1", "sk-acme-2"],
                "price_per_million_input_tokens": 0.2,
                "price_per_million_output_tokens": 0.6,
            },
            "beta": {"keys": ["sk-beta"]},
        }
    }
    expected = parse_tenants(YAML, "keys.yaml")
    assert parse_tenants(json.dumps(document), "keys.json") == expected
    assert parse_tenants(json.dumps(document, indent=2), "/etc/meterserve/keys") == expected
    # A JSON duplicate is caught by the JSON parser, which proves the content chose it.
    with pytest.raises(ValueError, match="not valid JSON.*duplicate field 'beta'"):
        parse_tenants('{"tenants": {"beta": {}, "beta": {}}}', "keys")


def test_yaml_extension_wins_over_json_looking_content():
    assert parse_tenants('{"tenants": {"beta": {keys: [k]}}}', "keys.yml") == (
        TenantSpec(BETA, ("k",)),
    )


def test_tenants_without_keys_or_body_and_empty_file_sections():
    assert parse_tenants("tenants:\n  gw:\n", "f.yaml") == (TenantSpec(Tenant("gw"), ()),)
    assert parse_tenants("tenants:\n", "f.yaml") == ()
    assert parse_tenants("tenants: {a.b_c-1: {keys: []}}", "f.yaml")[0].tenant.name == "a.b_c-1"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("tenants: {}\nextra: 1", "unknown field 'extra'"),
        ("- a\n- b", "expected a mapping with a 'tenants' field"),
        ("", "expected a mapping with a 'tenants' field"),
        ("tenants: [a, b]", "'tenants' must map tenant names"),
        ("tenants: {acme: {key: [x]}}", "tenant 'acme': unknown field 'key'"),
        ("tenants: {acme: [x]}", "tenant 'acme': expected a mapping"),
        ("tenants: {a: {keys: [x]}, b: {keys: [y, x]}}", "tenant 'b' keys\\[1\\] repeats a key"),
        ("tenants: {a: {keys: [x, x]}}", "tenant 'a' keys\\[1\\] repeats a key of tenant 'a'"),
        ("tenants: {a: {keys: ['']}}", "tenant 'a': keys\\[0\\] is empty"),
        ("tenants: {a: {keys: ['  ']}}", "tenant 'a': keys\\[0\\] is empty"),
        ("tenants: {a: {keys: [' x']}}", "keys\\[0\\] has leading or trailing whitespace"),
        ("tenants: {a: {keys: [123]}}", "keys\\[0\\] must be a string"),
        ("tenants: {a: {keys: sk-1}}", "'keys' must be a list of strings"),
        ("tenants: {'acme corp': {}}", "tenant 'acme corp': a name is 1-64 characters"),
        ("tenants: {" + "a" * 65 + ": {}}", "a name is 1-64 characters"),
        ("tenants: {'ácme': {}}", "a name is 1-64 characters"),
        ("tenants: {'a\"b': {}}", "a name is 1-64 characters"),
        ("tenants: {42: {}}", "tenant 42: a name is 1-64 characters"),
        ("tenants: {default: {}}", "tenant 'default': the name is reserved"),
        ("tenants: {other: {}}", "tenant 'other': the name is reserved"),
        ("tenants: {a: {}, a: {}}", "duplicate field 'a'"),
        (
            "tenants: {a: {price_per_million_input_tokens: 1}}",
            "price_per_million_input_tokens given without price_per_million_output_tokens",
        ),
        (
            "tenants: {a: {price_per_million_output_tokens: 1}}",
            "price_per_million_output_tokens given without price_per_million_input_tokens",
        ),
        (
            (
                "tenants: {a: {price_per_million_input_tokens: -1, "
                "price_per_million_output_tokens: 1}}"
            ),
            "price_per_million_input_tokens must be finite and >= 0",
        ),
        (
            (
                "tenants: {a: {price_per_million_input_tokens: 1, "
                "price_per_million_output_tokens: .inf}}"
            ),
            "price_per_million_output_tokens must be finite and >= 0",
        ),
        (
            (
                "tenants: {a: {price_per_million_input_tokens: '1', "
                "price_per_million_output_tokens: 1}}"
            ),
            "price_per_million_input_tokens must be a number",
        ),
        (
            (
                "tenants: {a: {price_per_million_input_tokens: true, "
                "price_per_million_output_tokens: 1}}"
            ),
            "must be a number",
        ),
        ("tenants: {a: [", "not valid YAML"),
    ],
)
def test_validation_errors_name_the_file_and_the_problem(text, problem):
    with pytest.raises(ValueError, match=f"(?s)^/etc/keys.yaml: .*{problem}"):
        TenantDirectory.build((), parse_tenants(text, "/etc/keys.yaml"), source="/etc/keys.yaml")


def test_errors_never_show_a_key():
    with pytest.raises(ValueError) as info:
        directory("tenants: {a: {keys: [sk-secret, sk-secret]}}")
    assert "sk-secret" not in str(info.value)


def test_a_plain_key_repeated_in_the_file_is_an_error(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(YAML)
    with pytest.raises(ValueError, match=f"{path}: tenant 'beta' keys\\[0\\] repeats .*--api-key"):
        load_tenant_directory(("sk-beta",), path)


def test_unreadable_file_names_it(tmp_path):
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ValueError, match=f"{missing}: cannot read"):
        load_tenant_directory((), missing)


def test_price_plan_validates():
    with pytest.raises(ValueError, match="price_per_million_output_tokens"):
        PricePlan(0.1, float("nan"))
    assert PricePlan(0, 0) == PricePlan(0.0, 0.0)


def test_resolve_finds_each_keys_tenant():
    tenants = directory(api_keys=("sk-plain", "sk-plain"))
    assert tenants.requires_auth
    assert tenants.resolve("sk-acme-1") == tenants.resolve("sk-acme-2") == ACME
    assert tenants.resolve("sk-beta") == BETA
    assert tenants.resolve("sk-plain") == DEFAULT_TENANT
    for wrong in ("sk-acme", "sk-acme-10", "", "SK-BETA", "sk-beta "):
        assert tenants.resolve(wrong) is None
    assert "sk-" not in repr(tenants)  # keys are stored only as digests


def test_resolve_compares_every_key(monkeypatch):
    tenants = directory(api_keys=("sk-plain",))
    calls = []

    def counting(a, b):
        calls.append(len(b))
        return real(a, b)

    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", counting)
    for token in ("sk-plain", "sk-beta", "nope"):
        calls.clear()
        tenants.resolve(token)
        # One comparison per key, however early the match, each of equal-length digests.
        assert calls == [32, 32, 32, 32]


def test_no_keys_means_no_auth():
    assert not TenantDirectory().requires_auth
    assert not directory("tenants: {gw: {}}").requires_auth
    assert TenantDirectory().resolve("anything") is None


def test_labels_are_bounded_by_the_cap():
    text = "tenants: {t1: {}, t2: {}, t3: {}}"
    tenants = directory(text, max_tenant_labels=2)
    assert tenants.tenant_names == ("t1", "t2", "t3")
    assert [tenants.label(name) for name in ("t1", "t2", "t3", "default", "stranger")] == [
        "t1", "t2", "other", "default", "other",
    ]  # fmt: skip
    assert tenants.label_values == ("default", "t1", "t2", "other")
    assert directory(text).label_values == ("default", "t1", "t2", "t3", "other")
    with pytest.raises(ValueError, match="max_tenant_labels"):
        directory(text, max_tenant_labels=0)


def test_directory_is_frozen_and_hashable():
    tenants = directory(tenant_header="X-Tenant")
    assert tenants.tenant_header == "x-tenant"
    assert hash(tenants) == hash(directory(tenant_header="x-tenant"))
    assert tenants == directory(tenant_header="x-tenant")
    with pytest.raises(AttributeError):
        tenants.tenant_header = None  # type: ignore[misc]


@pytest.mark.parametrize("name", ["", "X Tenant", "x:tenant", "Authorization"])
def test_bad_tenant_header_names(name):
    with pytest.raises(ValueError):
        TenantDirectory(tenant_header=name)


def test_direct_construction_checks_names():
    with pytest.raises(ValueError, match="unique"):
        TenantDirectory(tenants=(BETA, BETA))
    with pytest.raises(ValueError, match="unreserved"):
        TenantDirectory(tenants=(Tenant("other"),))


# --- require_api_key / tenant_for ---


def settings(text: str = YAML, api_keys=(), **kwargs) -> Settings:
    return Settings(api_keys=api_keys, tenants=directory(text, api_keys, **kwargs))


def headers(**values: str) -> Headers:
    return Headers({name.replace("_", "-"): value for name, value in values.items()})


def test_no_keys_bills_the_default_tenant_without_auth():
    assert tenant_for(Settings(), headers()) == DEFAULT_TENANT
    assert tenant_for(Settings(), headers(authorization="Bearer whatever")) == DEFAULT_TENANT


def test_key_names_the_tenant():
    s = settings(api_keys=("sk-plain",))
    assert tenant_for(s, headers(authorization="Bearer sk-acme-2")) == ACME
    assert tenant_for(s, headers(authorization="bearer  sk-beta ")) == BETA
    assert tenant_for(s, headers(authorization="Bearer sk-plain")) == DEFAULT_TENANT


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (None, "missing API key: send 'Authorization: Bearer <key>'"),
        ("Basic sk-beta", "missing API key"),
        ("Bearer ", "missing API key"),
        ("Bearer sk-wrong", "incorrect API key"),
    ],
)
def test_missing_or_unknown_key_is_401(authorization, message):
    given = headers() if authorization is None else headers(authorization=authorization)
    with pytest.raises(OpenAIError) as info:
        tenant_for(settings(), given)
    error = info.value
    assert (error.status, error.code) == (401, "invalid_api_key")
    assert error.message.startswith(message)
    assert error.headers == {"WWW-Authenticate": "Bearer"}


def test_tenant_header_is_ignored_unless_configured():
    given = headers(authorization="Bearer sk-beta", x_tenant="acme")
    assert tenant_for(settings(), given) == BETA
    assert tenant_for(Settings(), headers(x_tenant="acme")) == DEFAULT_TENANT
    assert tenant_for(Settings(), headers(x_tenant="not valid!")) == DEFAULT_TENANT


def test_tenant_header_without_keys():
    plan = "{price_per_million_input_tokens: 1, price_per_million_output_tokens: 2}"
    s = settings(f"tenants: {{acme: {plan}}}", tenant_header="X-Tenant")
    assert not s.tenants.requires_auth
    assert tenant_for(s, headers(x_tenant="acme")) == Tenant("acme", PricePlan(1, 2))
    stranger = tenant_for(s, headers(x_tenant="stranger"))
    assert stranger == Tenant("stranger", None) and s.tenants.label(stranger.name) == "other"
    assert tenant_for(s, headers(x_tenant="default")) == DEFAULT_TENANT
    assert tenant_for(s, headers()) == DEFAULT_TENANT


def test_tenant_header_with_keys_overrides_only_with_a_configured_name():
    s = settings(tenant_header="x-tenant")
    key = "Bearer sk-beta"
    assert tenant_for(s, headers(authorization=key, x_tenant="acme")) == ACME
    assert tenant_for(s, headers(authorization=key, x_tenant="stranger")) == BETA
    assert tenant_for(s, headers(authorization=key)) == BETA
    with pytest.raises(OpenAIError) as info:  # the header does not replace the key
        tenant_for(s, headers(x_tenant="acme"))
    assert info.value.status == 401


@pytest.mark.parametrize("raw", [[b""], [b"acme corp"], [b"a" * 65], [b"acme", b"beta"]])
def test_malformed_tenant_header_is_400(raw):
    s = settings("tenants: {acme: {}, beta: {}}", tenant_header="X-Tenant")
    with pytest.raises(OpenAIError) as info:
        tenant_for(s, Headers(raw=[(b"x-tenant", value) for value in raw]))
    assert (info.value.status, info.value.code) == (400, "invalid_tenant")
    assert "x-tenant" in info.value.message


def test_a_401_comes_before_a_400():
    s = settings(tenant_header="X-Tenant")
    with pytest.raises(OpenAIError) as info:
        tenant_for(s, headers(x_tenant="bad name"))
    assert info.value.status == 401


async def test_require_api_key_stores_the_tenant_on_the_request():
    app = SimpleNamespace(state=SimpleNamespace(settings=settings()))
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"authorization", b"Bearer sk-acme-1")],
        "app": app,
    }
    request = Request(scope)
    await require_api_key(request)
    assert request.state.tenant == ACME

    scope["headers"] = [(b"authorization", b"Bearer nope")]
    with pytest.raises(OpenAIError):
        await require_api_key(Request(scope))
