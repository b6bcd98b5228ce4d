"""Whose prefix cache a request may hit: the tenant, plus the client's own `cache_salt`.

A prefix-cache hit is visible to the client that gets it (`usage.prompt_tokens_details.
cached_tokens`, the progress stream, a shorter time to first token), so a cache shared by
tenants lets one tenant learn, 16 tokens at a time, how other tenants' prompts begin. By
default every request is therefore salted with its tenant (kvcache/prefix_hash.py folds the
salt into the root of its block chain) and hits only its own tenant's blocks; choices of one
request and prompt-logprob passes share the salt, so they still share blocks.
`--shared-prefix-cache` drops the tenant from the salt for operators whose tenants trust each
other (docs/metrics.md says what it leaks). vLLM's per-request `cache_salt` narrows the
sharing further, within the tenant.
"""

from __future__ import annotations

import json


def cache_salt(tenant: str, client_salt: str | None, shared_across_tenants: bool) -> str:
    """The engine's salt: "" (the unsalted chain) only when nothing separates requests.
    JSON keeps the two parts apart: no (tenant, salt) pair spells another pair."""
    scope = "" if shared_across_tenants else tenant
    if not scope and not client_salt:
        return ""
    return json.dumps([scope, client_salt or ""])
