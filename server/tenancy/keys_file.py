"""The keys file (`--api-keys-file`): tenants, their API keys and price plans, YAML or JSON (JSON
when the file name ends in .json, or has no .yaml/.yml ending and its text starts with "{"):

    tenants:
      acme:
        keys: ["sk-acme-1", "sk-acme-2"]
        price_per_million_input_tokens: 0.20   # optional, both or neither
        price_per_million_output_tokens: 0.60
      beta:
        keys: ["sk-beta"]

Unknown fields, a key given twice (within a tenant, across tenants, or also as an --api-key),
an empty key, a bad or reserved name (server/tenancy/tenants.py) or a price without the other
raise a TenantsFileError (a ValueError) whose message names the file and the problem; a key
itself never appears in a message.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from server.tenancy.tenants import (
    PRICE_FIELDS,
    RESERVED_NAMES,
    PricePlan,
    Tenant,
    TenantDirectory,
    TenantsFileError,
    TenantSpec,
    valid_tenant_name,
)

_TENANT_FIELDS = ("keys", *PRICE_FIELDS)


def load_tenant_directory(
    api_keys: Iterable[str] = (),
    api_keys_file: str | Path | None = None,
    *,
    tenant_header: str | None = None,
    max_tenant_labels: int = 100,
) -> TenantDirectory:
    """`TenantDirectory.build` from the plain keys and the keys file, read here (None = no
    file)."""
    specs = read_tenants_file(api_keys_file) if api_keys_file is not None else ()
    return TenantDirectory.build(
        api_keys,
        specs,
        source=str(api_keys_file),
        tenant_header=tenant_header,
        max_tenant_labels=max_tenant_labels,
    )


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
    if name in RESERVED_NAMES:
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
    given = [name for name in PRICE_FIELDS if body.get(name) is not None]
    if not given:
        return None
    if len(given) == 1:
        missing = next(name for name in PRICE_FIELDS if name not in given)
        raise TenantsFileError(
            f"{where}: {given[0]} given without {missing} (give both or neither)"
        )
    for name in PRICE_FIELDS:
        value = body[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TenantsFileError(f"{where}: {name} must be a number, got {value!r}")
    try:
        return PricePlan(*(float(body[name]) for name in PRICE_FIELDS))
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
