"""Tenants: who each request is billed to, and at which price plan.

A `TenantDirectory` is built once, from the plain `--api-key` keys (tenant "default", the
server's list prices) and the tenants of an optional `--api-keys-file` (its format and its
checks: server/tenancy/keys_file.py). A tenant without prices pays the server's list prices
(`plan=None`); a tenant without keys can only be named by the trusted header below. Tenant
names are 1-64 characters of A-Z a-z 0-9 _ . - (safe as Prometheus label values); "default"
and "other" are reserved.

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
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeGuard

DEFAULT_TENANT_NAME = "default"  # the plain --api-key keys, and every request without keys
OTHER_LABEL = "other"  # the metric label of every tenant beyond the cap or not configured
RESERVED_NAMES = (DEFAULT_TENANT_NAME, OTHER_LABEL)
# A price plan's fields, as the keys file spells them.
PRICE_FIELDS = ("price_per_million_input_tokens", "price_per_million_output_tokens")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP field-name token (RFC 9110)


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
        for name in PRICE_FIELDS:
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
        bad = [name for name in names if not valid_tenant_name(name) or name in RESERVED_NAMES]
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
