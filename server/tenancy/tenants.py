"""Tenants: who each request is billed to, and at which price plan.

A `TenantDirectory` is built once, from the plain `--api-key` keys (tenant "default", the
server's list prices) and an optional `--api-keys-file`, YAML or JSON (JSON when the file
name ends in .json, or has no .yaml/.yml ending and its text starts with "{"):

    tenants:
      acme:
        keys: ["sk-acme-1", "sk-acme-2"]
        price_per_million_input_tokens: 0.20   # optional, both or neither
        price_per_million_output_tokens: 0.60
      beta:
        keys: ["sk-beta"]

A tenant without prices pays the server's list prices (`plan=None`); a tenant without keys can
only be named by the trusted header below. Tenant names are 1-64 characters of A-Z a-z 0-9 _ . -
(safe as Prometheus label values); "default" and "other" are reserved. Unknown fields, a key
given twice (within a tenant, across tenants, or also as an --api-key), an empty key, a bad name
or a price without the other raise a TenantsFileError (a ValueError) whose message names the
file and the problem.

Keys are kept only as SHA-256 digests; a presented token is compared with every one of them,
each with hmac.compare_digest and no early exit, so timing reveals neither which key matched
nor how much of it, and digests of equal length hide the keys' lengths too.

Trusted gateway mode (`--tenant-header NAME`, off by default): a gateway in front of the server
authenticates callers and names their tenant in that header. Enable it only behind a gateway
that strips the header from client requests and sets it itself: the server believes whatever
the header says. With the flag unset the header is ignored entirely, even when a client sends
it. With the flag set and API keys configured, a valid key is still required, and the header
overrides the key's tenant only when it names a configured tenant; with no keys, a name that
is not configured is billed under that name at list prices and labelled "other".

Metric labels stay bounded: `label(name)` is the name for the first `max_tenant_labels`
tenants of the file (in file order), "default" for the default tenant, and "other" for
everything else, so at most max_tenant_labels + 2 distinct values exist.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import yaml

DEFAULT_TENANT_NAME = "default"  # the plain --api-key keys, and every request without keys
OTHER_LABEL = "other"  # the metric label of every tenant beyond the cap or not configured
_RESERVED_NAMES = (DEFAULT_TENANT_NAME, OTHER_LABEL)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP field-name token (RFC 9110)
_PRICE_FIELDS = ("price_per_million_input_tokens", "price_per_million_output_tokens")
_TENANT_FIELDS = ("keys", *_PRICE_FIELDS)


def valid_tenant_name(name: object) -> TypeGuard[str]:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


class TenantsFileError(ValueError):
    """A keys file cannot be read or is invalid; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class PricePlan:
    """A tenant's own list prices, in USD per million tokens (finite, >= 0)."""

    price_per_million_input_tokens: float
    price_per_million_output_tokens: float

    def __post_init__(self) -> None:
        for name in _PRICE_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is billed to; `plan=None` means the server's default list prices."""

    name: str
    plan: PricePlan | None = None


DEFAULT_TENANT = Tenant(DEFAULT_TENANT_NAME)


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant as the keys file declares it, keys still in plain text (until hashed)."""

    tenant: Tenant
    keys: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True, slots=True)
class _KeyDigest:
    digest: bytes = field(repr=False)  # SHA-256 of the key
    tenant: Tenant


@dataclass(frozen=True, slots=True)
class TenantDirectory:
    """Every API key's tenant, the configured tenants, and their bounded metric labels.

    Invariants: tenant names are valid, unreserved and unique; no key digest appears twice;
    `tenant_header` is None or a lower-case HTTP field name other than authorization.
    """

    tenants: tuple[Tenant, ...] = ()  # from the keys file, in file order
    keys: tuple[_KeyDigest, ...] = field(default=(), repr=False)
    tenant_header: str | None = None  # trusted gateway mode when set
    max_tenant_labels: int = 100
    _names: frozenset[str] = field(init=False, repr=False, compare=False)
    _labelled: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_tenant_labels < 1:
            raise ValueError(f"max_tenant_labels must be >= 1, got {self.max_tenant_labels}")
        if self.tenant_header is not None:
            check_header_name(self.tenant_header)
            object.__setattr__(self, "tenant_header", self.tenant_header.lower())
        names = [tenant.name for tenant in self.tenants]
        bad = [name for name in names if not valid_tenant_name(name) or name in _RESERVED_NAMES]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"tenant names must be valid, unreserved and unique: {names!r}")
        if len({entry.digest for entry in self.keys}) != len(self.keys):
            raise ValueError("a key belongs to more than one tenant")
        object.__setattr__(self, "_names", frozenset(names))
        object.__setattr__(self, "_labelled", frozenset(names[: self.max_tenant_labels]))

    @classmethod
    def build(
        cls,
        api_keys: Iterable[str] = (),
        specs: Iterable[TenantSpec] = (),
        *,
        source: str = "tenants",
        tenant_header: str | None = None,
        max_tenant_labels: int = 100,
    ) -> TenantDirectory:
        """Plain keys (tenant "default") plus the file's tenants; `source` names the file in
        errors. A plain key repeated is harmless; any other repeated key is an error."""
        owners: dict[str, str] = {}  # key -> who declared it, for the error message
        entries: list[_KeyDigest] = []
        for key in dict.fromkeys(api_keys):
            owners[key] = "--api-key"
            entries.append(_KeyDigest(_digest(key), DEFAULT_TENANT))
        specs = tuple(specs)
        for spec in specs:
            for index, key in enumerate(spec.keys):
                where = f"tenant {spec.tenant.name!r} keys[{index}]"
                if key in owners:
                    raise TenantsFileError(f"{source}: {where} repeats a key of {owners[key]}")
                owners[key] = f"tenant {spec.tenant.name!r}"
                entries.append(_KeyDigest(_digest(key), spec.tenant))
        return cls(
            tenants=tuple(spec.tenant for spec in specs),
            keys=tuple(entries),
            tenant_header=tenant_header,
            max_tenant_labels=max_tenant_labels,
        )

    @classmethod
    def load(
        cls,
        api_keys: Iterable[str] = (),
        api_keys_file: str | Path | None = None,
        *,
        tenant_header: str | None = None,
        max_tenant_labels: int = 100,
    ) -> TenantDirectory:
        """`build` from the plain keys and the keys file, read here (None = no file)."""
        specs = read_tenants_file(api_keys_file) if api_keys_file is not None else ()
        return cls.build(
            api_keys,
            specs,
            source=str(api_keys_file),
            tenant_header=tenant_header,
            max_tenant_labels=max_tenant_labels,
        )

    @property
    def requires_auth(self) -> bool:
        return bool(self.keys)

    @property
    def tenant_names(self) -> tuple[str, ...]:
        return tuple(tenant.name for tenant in self.tenants)

    @property
    def label_values(self) -> tuple[str, ...]:
        """Every value `label` can return: "default", the labelled tenants, "other"."""
        labelled = self.tenant_names[: self.max_tenant_labels]
        return (DEFAULT_TENANT_NAME, *labelled, OTHER_LABEL)

    def label(self, name: str) -> str:
        if name == DEFAULT_TENANT_NAME or name in self._labelled:
            return name
        return OTHER_LABEL

    def is_configured(self, name: str) -> bool:
        return name == DEFAULT_TENANT_NAME or name in self._names

    def named(self, name: str) -> Tenant:
        """The configured tenant called `name`, else a tenant of that name at list prices."""
        if name == DEFAULT_TENANT_NAME:
            return DEFAULT_TENANT
        return next((t for t in self.tenants if t.name == name), Tenant(name))

    def resolve(self, token: str) -> Tenant | None:
        """The tenant whose key is `token`, or None. Every key is compared (no early exit)."""
        presented = _digest(token)
        found: Tenant | None = None
        for entry in self.keys:
            if hmac.compare_digest(presented, entry.digest):
                found = entry.tenant
        return found


def key_matches(presented: str, keys: Iterable[str]) -> bool:
    """True when `presented` equals one of `keys`, compared like `TenantDirectory.resolve`."""
    candidate = _digest(presented)
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, _digest(key))
    return matched


def check_header_name(name: str) -> None:
    if _HEADER_NAME.fullmatch(name) is None:
        raise ValueError(f"not an HTTP header name: {name!r}")
    if name.lower() == "authorization":
        raise ValueError("the tenant header cannot be Authorization, which carries the API key")


def _digest(key: str) -> bytes:
    # surrogateescape: a header decoded as latin-1 or a key with odd bytes still encodes.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def read_tenants_file(path: str | Path) -> tuple[TenantSpec, ...]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"{path}: cannot read: {exc}") from exc
    return parse_tenants(text, str(path))


def parse_tenants(text: str, source: str) -> tuple[TenantSpec, ...]:
    """The tenants of a keys file's text, in file order; `source` names the file in errors."""
    document = _parse_document(text, source)
    if not isinstance(document, Mapping) or "tenants" not in document:
        raise TenantsFileError(f"{source}: expected a mapping with a 'tenants' field")
    _reject_unknown(source, document, ("tenants",))
    tenants = document["tenants"] or {}  # `tenants:` with nothing under it is empty
    if not isinstance(tenants, Mapping):
        raise TenantsFileError(f"{source}: 'tenants' must map tenant names to their settings")
    return tuple(_parse_tenant(source, name, body) for name, body in tenants.items())


def _parse_document(text: str, source: str) -> Any:
    suffix = Path(source).suffix.lower()
    as_json = suffix == ".json" or (
        suffix not in (".yaml", ".yml") and text.lstrip().startswith("{")
    )
    try:
        if as_json:
            return json.loads(text, object_pairs_hook=_unique_pairs)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if as_json else "YAML"
        raise TenantsFileError(f"{source}: not valid {kind}: {exc}") from exc


def _parse_tenant(source: str, name: object, body: object) -> TenantSpec:
    where = f"{source}: tenant {name!r}"
    if not valid_tenant_name(name):
        raise TenantsFileError(f"{where}: a name is 1-64 characters of A-Z a-z 0-9 _ . -")
    if name in _RESERVED_NAMES:
        raise TenantsFileError(f"{where}: the name is reserved")
    body = body or {}  # `beta:` with nothing under it: no keys, list prices
    if not isinstance(body, Mapping):
        raise TenantsFileError(f"{where}: expected a mapping of {', '.join(_TENANT_FIELDS)}")
    _reject_unknown(where, body, _TENANT_FIELDS)
    return TenantSpec(Tenant(name, _parse_plan(where, body)), _parse_keys(where, body))


def _parse_keys(where: str, body: Mapping[str, Any]) -> tuple[str, ...]:
    keys = body.get("keys")
    if keys is None:
        return ()
    if not isinstance(keys, list):
        raise TenantsFileError(f"{where}: 'keys' must be a list of strings")
    for index, key in enumerate(keys):
        # The message names the key's index only: keys are secrets.
        if not isinstance(key, str):
            raise TenantsFileError(f"{where}: keys[{index}] must be a string")
        if not key.strip():
            raise TenantsFileError(f"{where}: keys[{index}] is empty")
        if key != key.strip():
            # The bearer token is stripped before matching, so such a key could never match.
            raise TenantsFileError(f"{where}: keys[{index}] has leading or trailing whitespace")
    return tuple(keys)


def _parse_plan(where: str, body: Mapping[str, Any]) -> PricePlan | None:
    given = [name for name in _PRICE_FIELDS if body.get(name) is not None]
    if not given:
        return None
    if len(given) == 1:
        missing = next(name for name in _PRICE_FIELDS if name not in given)
        raise TenantsFileError(
            f"{where}: {given[0]} given without {missing} (give both or neither)"
        )
    for name in _PRICE_FIELDS:
        value = body[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TenantsFileError(f"{where}: {name} must be a number, got {value!r}")
    try:
        return PricePlan(*(float(body[name]) for name in _PRICE_FIELDS))
    except ValueError as exc:
        raise TenantsFileError(f"{where}: {exc}") from exc


def _reject_unknown(where: str, mapping: Mapping[Any, Any], allowed: tuple[str, ...]) -> None:
    unknown = [key for key in mapping if key not in allowed]
    if unknown:
        raise TenantsFileError(
            f"{where}: unknown field {unknown[0]!r} (expected {', '.join(allowed)})"
        )


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate field {key!r}")
        result[key] = value
    return result


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a mapping key given twice (PyYAML keeps the last silently,
    which would merge two tenants of the same name)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)  # resolve `<<` merges first, as construct_mapping does
    seen: set[str] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, str):
            continue  # names and fields are strings; other keys are rejected later
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate field {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)
