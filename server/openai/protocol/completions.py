"""POST /v1/completions' request and response models (prompt, echo, logprobs of the prompt
and the completion, vLLM's prompt_logprobs)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from server.openai.fields import COMPLETIONS_REFUSED, check_extra_fields
from server.openai.protocol.request_fields import MAX_TOP_LOGPROBS, SamplingFields
from server.openai.protocol.response_fields import ProgressField, Usage, is_unset

PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # vLLM's extension: each prompt token's logprob and the top-k at its position, returned
    # in the choice's `prompt_logprobs` (docs/api.md). Not with stream, as in vLLM.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def check_fields(self) -> None:
        check_extra_fields(self.model_extra, COMPLETIONS_REFUSED, "the request")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: a token's logprob at one prompt position, its rank in the vocabulary
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` of a choice: one entry per prompt token, null for the first (it has
# no context), then {token id: PromptLogprob} for the prompt token and the top-k at its
# position. Present only when the request asked for it.
PromptLogprobsField = Annotated[
    list[dict[int, PromptLogprob] | None] | None, Field(exclude_if=is_unset)
]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    meterserve: ProgressField = None
