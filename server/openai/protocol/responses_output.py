"""OpenAI Responses API response models (`POST /v1/responses`): the response object, its
output items (messages, function calls) and usage.

They mirror the wire format of the `openai` package's `Response` types (the SDK parses them;
tests/integration/test_responses_api.py checks it); they are our own because the `openai`
package is not a server dependency.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    """A call the model made: `call_id` pairs it with the function_call_output the client
    sends back."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # the arguments object as JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    # OpenAI's separately billed writes of explicit prompt caching; meterserve bills every
    # uncached input token alike, so none is a cache write.
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Responses' token counts, plus the meter's extension fields chat's `usage` carries
    (cost_usd, revenue_usd, seconds, FLOPs; docs/metrics.md)."""

    model_config = ConfigDict(extra="allow")

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    model: str
    output: list[OutputItem]
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    text: dict[str, Any]  # {"format": the request's text.format, or {"type": "text"}}
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    store: Literal[False] = False  # stateless: nothing can be retrieved by this id
    background: Literal[False] = False
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
