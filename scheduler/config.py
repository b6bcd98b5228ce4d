"""SchedulerConfig: every policy knob of the scheduler, frozen and built once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scheduler.speculative_config import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Policy knobs. Each one is documented where the policy uses it (scheduler/scheduler.py)."""

    max_num_seqs: int = 128  # cap on requests in the running batch
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes + prefill chunks)
    max_model_len: int = 8192  # prompt + output tokens of one request
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # Most prompt tokens one request computes in a step (vLLM's name); 0 = the whole budget.
    # Below the budget, a long prompt leaves room in every step for other requests' admission.
    long_prefill_token_threshold: int = 0
    # Draft tokens for decodes, verified in the same pass (None: one token per pass).
    speculative: SpeculativeConfig | None = None
    # Rows (decodes and their drafts) a step's drafts may bring it to, shared evenly among the
    # running requests; 0: only the token budget. The engine sets it where a pass of more rows
    # takes a much dearer path (a GGUF model on AMX: its blocks' tiles, then the bf16 copy).
    draft_step_rows: int = 0

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens one request's prefill chunk may have."""
        return min(
            self.long_prefill_token_threshold or self.max_num_batched_tokens,
            self.max_num_batched_tokens,
        )

    @property
    def max_request_step_tokens(self) -> int:
        """The most tokens one request computes in one step: a prefill chunk, or with chunked
        prefill off a whole admitted rest, up to the step budget."""
        return self.max_chunk_tokens if self.enable_chunked_prefill else self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.draft_step_rows < 0:
            raise ValueError("draft_step_rows must be >= 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
