"""SpeculativeConfig: how draft tokens are proposed for a request to verify in one pass."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM's keys for each method served; any other key is refused rather than ignored.
_COMMON_KEYS = frozenset(
    {
        "method",
        "num_speculative_tokens",
        "max_backoff_steps",  # ours (scheduler/draft_backoff.py), not vLLM's
    }
)
_KEYS = {
    "ngram": _COMMON_KEYS | {"prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": _COMMON_KEYS | {"model"},
}
_INTEGER_KEYS = (
    "num_speculative_tokens",
    "max_backoff_steps",
    "prompt_lookup_max",
    "prompt_lookup_min",
)
MAX_SPECULATIVE_TOKENS = 16  # a longer draft is almost never accepted whole


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculation: each decode carries up to num_speculative_tokens draft tokens, which the
    target model checks all in the same forward pass.

    method "ngram" (prompt lookup): the longest suffix of a request's tokens of length in
    [prompt_lookup_min, prompt_lookup_max] that occurred earlier in its tokens proposes the
    tokens that followed it there (scheduler/ngram_proposer.py).
    method "draft_model": a smaller model sharing the target's vocabulary (`model`, a path as
    --model takes) proposes them greedily, one pass per draft, all drafting requests batched
    (engine/draft_model.py); the scheduler only reserves their slots.

    A request whose drafts were all rejected drafts nothing for a while, doubling up to
    max_backoff_steps decodes (scheduler/draft_backoff.py; 0: always draft).
    """

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    method: str = "ngram"
    max_backoff_steps: int = 8
    model: str | None = None  # the draft model (method "draft_model")

    def __post_init__(self) -> None:
        if self.method not in _KEYS:
            raise ValueError(
                f"speculative method {self.method!r} is not served: 'ngram' (prompt lookup) "
                "or 'draft_model'"
            )
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError("a draft model (\"model\") goes with method 'draft_model', and only")
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
        K, "prompt_lookup_max": N, "prompt_lookup_min": M} (one of the two lookup sizes given
        sets the other, vLLM's rule; neither: 5), or {"model": PATH, "num_speculative_tokens":
        K} (method "draft_model"). Raises ValueError naming what is wrong."""
        try:
            fields: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("--speculative-config must be a JSON object")  # noqa: TRY004
        # vLLM's rule: a "model" without a method is a draft model.
        method = fields.get("method") or ("draft_model" if "model" in fields else "ngram")
        if method not in _KEYS:
            raise ValueError(
                f"speculative method {method!r} is not served: 'ngram' (prompt lookup) "
                "or 'draft_model'"
            )
        unknown = sorted(set(fields) - _KEYS[method])
        if unknown:
            raise ValueError(
                f"--speculative-config has unsupported keys for method {method!r}: "
                f"{', '.join(unknown)}"
            )
        if "num_speculative_tokens" not in fields:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        for key in _INTEGER_KEYS:
            value = fields.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"--speculative-config {key} must be an integer, got {value!r}")
        if method == "draft_model":
            model = fields.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "--speculative-config method 'draft_model' needs \"model\": a path"
                )
            return cls(
                num_speculative_tokens=fields["num_speculative_tokens"],
                method=method,
                max_backoff_steps=fields.get("max_backoff_steps", 8),
                model=model,
            )
        lookup_max = fields.get("prompt_lookup_max")
        lookup_min = fields.get("prompt_lookup_min")
        lookup_max = lookup_max if lookup_max is not None else (lookup_min or 5)
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        return cls(
            num_speculative_tokens=fields["num_speculative_tokens"],
            prompt_lookup_max=lookup_max,
            prompt_lookup_min=lookup_min,
            method=method,
            max_backoff_steps=fields.get("max_backoff_steps", 8),
        )
