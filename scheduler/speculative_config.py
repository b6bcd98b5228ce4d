"""SpeculativeConfig: how the scheduler drafts tokens for a request to verify in one pass."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM's keys for the "ngram" method; any other key is refused rather than ignored.
_NGRAM_KEYS = frozenset(
    {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "max_backoff_steps",  # ours (scheduler/draft_backoff.py), not vLLM's
    }
)
MAX_SPECULATIVE_TOKENS = 16  # a longer draft is almost never accepted whole


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """N-gram (prompt-lookup) speculation: before each decode step, the longest suffix of a
    request's tokens of length in [prompt_lookup_min, prompt_lookup_max] that occurred earlier
    in its tokens proposes the up to num_speculative_tokens tokens that followed it there
    (scheduler/ngram_proposer.py). The target model checks them all in the same forward pass.
    A request whose drafts were all rejected drafts nothing for a while, doubling up to
    max_backoff_steps decodes (scheduler/draft_backoff.py; 0: always draft).
    """

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    method: str = "ngram"
    max_backoff_steps: int = 8

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(
                f"speculative method {self.method!r} is not served: only 'ngram' (prompt lookup)"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.max_backoff_steps < 0:
            raise ValueError(f"max_backoff_steps must be >= 0, got {self.max_backoff_steps}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse vLLM's --speculative-config JSON: {"method": "ngram", "num_speculative_tokens":
        K, "prompt_lookup_max": N, "prompt_lookup_min": M}. One of the two lookup sizes given
        sets the other (vLLM's rule); neither: 5. Raises ValueError naming what is wrong."""
        try:
            fields: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")  # noqa: TRY004
        if "model" in fields or fields.get("method") == "draft_model":
            raise ValueError(
                "speculation with a draft model is not served: use method 'ngram' (prompt lookup)"
            )
        unknown = sorted(set(fields) - _NGRAM_KEYS)
        if unknown:
            raise ValueError(f"--speculative-config has unsupported keys: {', '.join(unknown)}")
        if "num_speculative_tokens" not in fields:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        for key in _NGRAM_KEYS - {"method"}:
            value = fields.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"--speculative-config {key} must be an integer, got {value!r}")
        lookup_max = fields.get("prompt_lookup_max")
        lookup_min = fields.get("prompt_lookup_min")
        lookup_max = lookup_max if lookup_max is not None else (lookup_min or 5)
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        return cls(
            num_speculative_tokens=fields["num_speculative_tokens"],
            prompt_lookup_max=lookup_max,
            prompt_lookup_min=lookup_min,
            method=fields.get("method", "ngram"),
            max_backoff_steps=fields.get("max_backoff_steps", 8),
        )
