"""Request: one sequence's tokens, progress and lifecycle, owned by the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.draft_backoff import DraftBackoff
from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """The one lifecycle enum: WAITING -> RUNNING -> (PREEMPTED -> WAITING)* -> FINISHED_*.

    Finished states are ordered last so `is_finished` is one comparison.
    """

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# The single table from finished states to OpenAI's finish_reason.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps (time.monotonic seconds) of one request's life; None until reached."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class RequestCost:
    """What one request consumed, attributed by the engine step by step (each step's time split
    by roofline share, engine/meter/attribution.py)."""

    prefill_flops: float = 0.0
    decode_flops: float = 0.0
    prefill_seconds: float = 0.0  # attributed busy time of the steps' prefill share
    decode_seconds: float = 0.0
    prefill_bytes: float = 0.0
    decode_bytes: float = 0.0


@dataclass(slots=True)
class Request:
    """One sequence: prompt + generated tokens in `token_ids`, progress in `num_computed_tokens`.

    Invariants: 0 <= num_computed_tokens <= num_tokens; token_ids[:num_prompt_tokens] is the
    prompt. The scheduler owns `status`; the HTTP layer only reads it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower value runs first under the "priority" policy
    # Prefix-cache key: only requests with the same salt share cached blocks (the server
    # salts by tenant, so a tenant never hits, or learns of, another tenant's prompts).
    cache_salt: str = ""
    # Whose line it waits in: admission takes turns between tenants (scheduler rule 6).
    tenant: str = ""
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    error: str | None = None  # why it ended, for FINISHED_ERROR / FINISHED_ABORTED
    times: RequestTimes = field(init=False)
    cost: RequestCost = field(default_factory=RequestCost)
    draft_backoff: DraftBackoff = field(default_factory=DraftBackoff)  # speculative decoding

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.times = RequestTimes(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
