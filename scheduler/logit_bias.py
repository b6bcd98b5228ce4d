"""LogitBias: a request's additive logit biases, validated once and shared by every choice.

A client may send a bias for every token of the vocabulary (tens of thousands of entries) and
ask for many choices. The biases are therefore parsed and checked once per API request, held
here as two flat machine arrays (token ids sorted ascending, their biases), and shared by all
the request's choices; the sampler reads the arrays as tensors without copying
(`torch.frombuffer`), so a step never loops over the entries in Python.

Equality and hashing are by identity (eq=False): comparing two 50k-entry biases would cost
what the sharing saves, and nothing needs two equal biases to compare equal.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_BIAS, MAX_BIAS = -100.0, 100.0  # OpenAI's range


@dataclass(frozen=True, slots=True, eq=False)
class LogitBias:
    """token_ids[i] gets values[i] added to its logit. Invariants: token ids are unique,
    non-negative and ascending; every value is in [MIN_BIAS, MAX_BIAS]."""

    token_ids: array = field(default_factory=lambda: array("q"))  # int64
    values: array = field(default_factory=lambda: array("f"))  # float32

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, float]]) -> LogitBias:
        """From (token id, bias) pairs; ValueError naming the bad entry."""
        ordered = sorted(pairs)
        for (token_id, _), (next_id, _) in itertools.pairwise(ordered):
            if token_id == next_id:
                raise ValueError(f"logit_bias token id {token_id} is given twice")
        if ordered and ordered[0][0] < 0:
            raise ValueError(f"logit_bias token id {ordered[0][0]} is negative")
        for _, bias in ordered:
            if not MIN_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias value {bias} not in [{MIN_BIAS:g}, {MAX_BIAS:g}]")
        return cls(array("q", [t for t, _ in ordered]), array("f", [b for _, b in ordered]))

    def __len__(self) -> int:
        return len(self.token_ids)

    def __bool__(self) -> bool:
        return len(self.token_ids) > 0

    def num_below(self, vocab_size: int) -> int:
        """How many entries index a logits row of `vocab_size` (they come first)."""
        return bisect.bisect_left(self.token_ids, vocab_size)

    def pairs(self) -> list[tuple[int, float]]:
        return list(zip(self.token_ids, self.values, strict=True))


NO_LOGIT_BIAS = LogitBias()
