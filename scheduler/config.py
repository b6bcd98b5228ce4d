"""SchedulerConfig: every policy knob of the scheduler, frozen and built once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Policy knobs. Each one is documented where the policy uses it (scheduler/scheduler.py)."""

    max_num_seqs: int = 128  # cap on requests in the running batch
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes + prefill chunks)
    max_model_len: int = 8192  # prompt + output tokens of one request
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
