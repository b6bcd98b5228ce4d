"""Plain values that flow between schedule(), the model runner and update()."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import RequestCost, RequestTimes
from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: compute `token_ids` at positions start_position.. .

    token_ids == request.token_ids[start_position : start_position + n] + draft_token_ids,
    n = len(token_ids) - len(draft_token_ids).
    `samples` is True when the chunk reaches the end of the request's known tokens, so the
    runner must sample one next token for it (a mid-prompt prefill chunk samples nothing).
    A decode with drafts (speculative decoding, SchedulerConfig.speculative) samples at its
    last known token and at each draft: the runner returns the drafts the model agrees with,
    in order, and the token it sampled after them (RunnerOutput).
    prompt_token_ids / output_token_ids are read-only views for penalties and min_tokens.

    Prompt logprobs (SamplingParams.prompt_logprobs): for each position p in
    [prompt_logprobs_start, prompt_logprobs_end) the runner reports the logprob of prompt
    token p + 1, from the logits at row p. The range lies inside the chunk and below the
    prompt's last position (whose logits sample the first output token):
        start_position <= prompt_logprobs_start <= prompt_logprobs_end
                       <= min(context_len, num_prompt_tokens - 1)
    It is empty for every other request, and for positions already reported before a
    preemption (a recompute reports nothing twice).
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    samples: bool
    num_prompt_tokens: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()
    prompt_logprobs_start: int = 0
    prompt_logprobs_end: int = 0
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Rows sampled for this chunk: its last known token's and one per draft."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Rows whose logits the runner computes for prompt logprobs (beyond sampling)."""
        return self.prompt_logprobs_end - self.prompt_logprobs_start

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this chunk is written (attended by its last token)."""
        return self.start_position + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """A single new token past the prompt (and its drafts, if any). Recompute after
        preemption counts as prefill."""
        return (
            len(self.token_ids) == 1 + len(self.draft_token_ids)
            and self.start_position >= self.num_prompt_tokens
        )


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes. Decode chunks come first, then prefill chunks."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the previous step: the runner drops their
    # per-request state (seeded generators).
    finished_request_ids: list[str] = field(default_factory=list)
    num_waiting: int = 0  # waiting requests left after this step's admissions
    num_running: int = 0  # requests in the running batch after this step's admissions
    num_preemptions: int = 0  # preemptions made while building this output
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up at admission this step
    prefix_cache_hit_tokens: int = 0  # of which were found cached
    # Block references a sliding window dropped while building this output (scheduler rule 9).
    num_window_freed_blocks: int = 0
    # The engine step this output is (1, 2, ... counting steps that compute something); None
    # for an output that schedules nothing. One step is one forward pass over every chunk.
    step_index: int | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks if not c.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        """Decoding requests (each computes one known token, plus its drafts if any)."""
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(c.num_draft_tokens for c in self.chunks)

    @property
    def num_drafting_requests(self) -> int:
        return sum(1 for c in self.chunks if c.draft_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the chosen token and the top alternatives (descending).

    rank: the token's rank in the vocabulary (1 = most likely; 1 + the number of tokens
    strictly more likely), set for prompt logprobs; None where it was not computed.
    """

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class RunnerOutput:
    """What the model runner returns: one sampled token per chunk with samples=True, and for
    a chunk with prompt-logprob rows the logprobs of prompt tokens prompt_logprobs_start + 1
    .. prompt_logprobs_end, in order.

    A chunk with drafts also gets accepted_draft_token_ids: the leading drafts the verification
    kept (possibly none), which come before its sampled token; logprobs requested are then
    accepted_logprobs (one per accepted draft) followed by logprobs (the sampled token's)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    accepted_draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

    @property
    def num_accepted_draft_tokens(self) -> int:
        return sum(len(ids) for ids in self.accepted_draft_token_ids.values())


@dataclass(frozen=True, slots=True)
class ChunkProgress:
    """What one step computed for a request that asked for progress
    (SamplingParams.report_progress): which step, which positions, and the request's
    attributed cost so far, this step included (a copy: it crosses to the server's thread).

    Positions start_position .. start_position + num_new_tokens - 1 were computed; prompt
    positions below the first chunk's start_position were prefix-cache hits.
    """

    step_index: int
    is_decode: bool
    start_position: int
    num_new_tokens: int
    num_prompt_tokens: int
    num_scheduled_requests: int  # chunks in the step's forward pass, this one included
    computed_at: float  # time.monotonic() when update() applied the step
    cost: RequestCost
    # Speculative decoding: drafts among the new tokens, and how many the model agreed with.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def num_prompt_tokens_computed(self) -> int:
        """Prompt tokens whose K/V are in the cache once this chunk is written."""
        return min(self.start_position + self.num_new_tokens, self.num_prompt_tokens)


@dataclass(slots=True)
class TokenEvent:
    """What a request's consumer receives after a step: new tokens, and the end when finished.

    new_token_ids is empty for a request that ended without a token (abort, error), and for a
    prefill chunk that sampled nothing, reported only to a request that asked for progress
    (then `progress` is set) or for prompt logprobs (then `prompt_logprobs` holds the chunk's);
    such an event is not final.
    prompt_logprobs: logprobs of the next prompt tokens this step computed, in prompt order
    (tokens 1 .. num_prompt_tokens - 1 over the request's events, each once; token 0 has none).
    finish_reason is one of FINISH_REASONS' values, or None while running.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Monotonic time the newest token was produced, and the one before it (for inter-token
    # latency); None where there is no such token.
    produced_at: float | None = None
    previous_token_at: float | None = None
    arrival_time: float | None = None  # the request's arrival (monotonic), for TTFT
    # Set on the finishing event only: the request's timestamps and attributed cost.
    times: RequestTimes | None = None
    cost: RequestCost | None = None
    # Set on every event of a step for a request that asked for progress; None otherwise.
    progress: ChunkProgress | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
