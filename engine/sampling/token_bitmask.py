"""Allowed-token bitmasks (structured outputs): masked tokens' logits become -inf.

A bitmask row is int32 [ceil(V / 32)]: token v is allowed when bit v % 32 of word v // 32 is
set (xgrammar's layout). reference.reference_token_bitmask is the plain-torch definition.
"""

from __future__ import annotations

import torch
import xgrammar as xgr


def apply_token_bitmask(work: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place on float32 work [P, V]: each row r in rows keeps only the tokens bitmask[r]
    ([P, W] int32, W * 32 >= V) allows; other rows are not read or written."""
    if rows:
        # xgrammar's CPU kernel; indices picks the same rows of work and bitmask.
        xgr.apply_token_bitmask_inplace(work, bitmask, vocab_size=work.shape[1], indices=rows)
