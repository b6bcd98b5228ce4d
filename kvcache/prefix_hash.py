"""Chained hash of a full block of token ids: the key of the prefix cache.

hash_block(parent, tokens) covers the whole prefix up to and including this block, because it
folds in the parent block's hash. Two blocks with equal tokens but different prefixes therefore
get different hashes, and a lookup can walk a prompt block by block.

Why sha256 (truncated to 64 bits) and not Python's hash() of an int tuple: tuple hashing of ints
is unsalted, but it is not a documented stable format across Python versions, and it is easy to
collide on purpose. A prefix-cache hit shares KV between users, so a crafted collision would let
one user's prompt read another user's cached keys/values. sha256 is stable everywhere, and
finding a second prompt that matches a given block's 64-bit truncation still costs ~2^64 work.
Cost: about a microsecond per block, paid once per block (hashes are kept per request).

Salting: a hit tells the client (through `cached_tokens` and through time to first token) that
someone sent the same prefix, so a shared cache lets one tenant probe another's prompts block
by block. A request's `cache_salt` (the server puts the tenant in it, plus vLLM's per-request
`cache_salt`) is folded into the root of its chain: requests with different salts never share
a block; the empty salt is the unsalted chain of a single-tenant server.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Stands in for the parent of a request's first block; any fixed bytes work.
_ROOT = b"meterserve-prefix-root\x00\x00"


def chain_root(cache_salt: str) -> int | None:
    """The parent hash of a request's first block: None (the fixed root) for the empty salt,
    else a 64-bit hash of the salt that no unsalted chain starts from."""
    if not cache_salt:
        return None
    digest = hashlib.sha256(b"meterserve-prefix-salt\x00" + cache_salt.encode("utf-8"))
    return int.from_bytes(digest.digest()[:8], "little")


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """64-bit chained hash of one full block (token ids are encoded as little-endian int64)."""
    digest = hashlib.sha256()
    digest.update(_ROOT if parent_hash is None else parent_hash.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(digest.digest()[:8], "little")
