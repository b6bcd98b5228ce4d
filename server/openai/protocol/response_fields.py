"""What every generation response shares: usage (with the meter's extension fields), the
streamed progress object (`meterserve`), and `dump`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts, plus the meter's per-request extension fields (cost, timings)."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class StreamProgress(BaseModel):
    """The `meterserve` object of a streamed chunk with stream_options.include_progress: one
    forward pass's work on one choice (docs/console.md). Costs and FLOPs are the choice's
    running totals, this pass included; the final usage chunk has the settled bill."""

    index: int  # the choice
    forward_pass: int  # the engine step (shared by every request in the same batch)
    phase: Literal["prefill", "decode"]
    batch_size: int  # requests in this forward pass
    start_position: int  # first position this pass computed for the choice
    num_tokens: int  # positions it computed (a prefill chunk's length; in decode 1 + drafts)
    prompt_tokens: int
    prompt_tokens_computed: int  # prompt tokens with K/V cached after this pass
    token_ids: list[int] = Field(default_factory=list)  # tokens this pass produced
    elapsed_seconds: float  # the request's arrival to the end of this pass (server clock)
    prefill_flops: float
    decode_flops: float
    prefill_cost_usd: float
    decode_cost_usd: float
    draft_tokens: int = 0  # speculative decoding: drafts this decode pass verified
    accepted_draft_tokens: int = 0  # of which the model agreed with (in token_ids)


def is_unset(value: Any) -> bool:
    return value is None


# Present only on the chunks of a request that asked for progress.
ProgressField = Annotated[StreamProgress | None, Field(exclude_if=is_unset)]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
