"""SamplingParams: how one request picks its next token and when it stops."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.logit_bias import NO_LOGIT_BIAS, LogitBias


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20

STRUCTURED_OUTPUT_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output, as plain data (compiled by the engine, cached by
    (kind, spec)): kind is one of STRUCTURED_OUTPUT_KINDS; spec is a JSON schema's text
    (json_schema), a regex, an EBNF grammar, a JSON list of strings (choice), or "" for
    json_object (any JSON object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_OUTPUT_KINDS,
            "response_format",
            f"structured output kind must be one of {STRUCTURED_OUTPUT_KINDS}, got {self.kind!r}",
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Frozen, validated sampling parameters of one request (one choice; n is the caller's)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None = no logprobs; k = chosen token plus top-k alternatives
    # Validated once per API request (LogitBias.of) and shared by its choices.
    logit_bias: LogitBias = NO_LOGIT_BIAS
    # None = no prompt logprobs; k = each prompt token's logprob (the first token's is not
    # defined) plus the top-k alternatives at its position, computed from the raw logits during
    # prefill. A request that asks computes its whole prompt: it takes no prefix-cache hit.
    prompt_logprobs: int | None = None
    # Not sampling: ask update() for a ChunkProgress on every step of this request, and for a
    # progress event on prefill chunks that sample nothing (the streaming API's
    # stream_options.include_progress). Off, a request costs the scheduler nothing extra.
    report_progress: bool = False
    # None = unconstrained; else only tokens the grammar allows are sampled (the sampler masks
    # the row), and once the grammar is complete only EOS is.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check(
            self.max_tokens >= 1, "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"
        )
        _check(
            self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"
        )
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            0.0 <= self.temperature <= 2.0,
            "temperature",
            f"temperature must be in [0, 2], got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"top_k must be >= 0 (0 disables), got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
        )
        if self.structured_output is not None:
            # A grammar that completes early leaves only EOS allowed: banning it (min_tokens)
            # would leave no token at all, and ignoring it would run past the grammar's end.
            for name in ("min_tokens", "ignore_eos"):
                _check(
                    not getattr(self, name),
                    name,
                    f"{name} cannot be combined with structured output (response_format)",
                )
        for token_id in self.stop_token_ids:
            _check(token_id >= 0, "stop_token_ids", f"stop token id {token_id} is negative")

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax; the sampler takes its fast path."""
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
