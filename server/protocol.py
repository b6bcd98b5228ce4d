"""OpenAI request/response models (pydantic, the HTTP edge only).

Requests are strict (a string where a number belongs is a 400, not coerced). Every field
OpenAI defines is honoured, refused with a 400 naming it, or accepted and ignored because it
cannot change the output (server/openai_fields.py, docs/api.md); fields OpenAI does not
define are ignored with a log warning, as vLLM does. Range checks live in one place,
`SamplingParams`, except the few that only the HTTP layer knows (n, logprobs counts, prompt
shape).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema

from scheduler.logit_bias import LogitBias
from server.openai_fields import (
    CHAT_REFUSED,
    COMPLETIONS_REFUSED,
    MESSAGE_REFUSED,
    check_extra_fields,
)
from server.request_limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    parse_logit_bias,
)
from server.tool_calls.tools import check_function_tool

MAX_TOP_LOGPROBS = 20

# OpenAI's {"token id": bias} object, parsed once while the body is validated (server/body.py
# does that off the event loop for a large body) into the LogitBias every choice shares.
LogitBiasField = Annotated[
    LogitBias | None,
    PlainValidator(parse_logit_bias),
    WithJsonSchema({"type": "object", "additionalProperties": {"type": "number"}}),
]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
# vLLM's per-request prefix-cache key: only requests with the same salt (and tenant) share
# cached blocks.
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class _Request(BaseModel):
    # extra="allow": the fields we do not model are kept, so check_fields() can refuse the
    # OpenAI ones we do not honour by name instead of dropping them.
    model_config = ConfigDict(strict=True, extra="allow")

    def check_fields(self) -> None:
        """400 for a refused OpenAI field; log the ones OpenAI does not define."""
        check_extra_fields(self.model_extra, {}, type(self).__name__)


class StreamOptions(_Request):
    include_usage: bool = False
    # meterserve extension (docs/api.md, docs/console.md): each chunk carries a `meterserve`
    # object saying which forward pass produced it, plus progress-only chunks for prefill
    # chunks that sample nothing.
    include_progress: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema; the schema is always enforced (strict or not)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's structured_outputs: exactly one constraint. Options of vLLM's we do not model
    are a 400 here (extra="forbid"), not dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # int64, as OpenAI
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's text extensions (server/detokenizer.py): show the matched stop string, and keep
    # or drop special tokens' text.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's extension: lower runs first (--scheduling-policy priority)
    logit_bias: LogitBiasField = None
    cache_salt: CacheSalt | None = None
    # Structured outputs (server/sampling.py structured_output_of): OpenAI's response_format,
    # or vLLM's structured_outputs extension; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older spelling of structured_outputs (server/guided_decoding.py): aliases, or a
    # 400 naming the field when meterserve cannot honour it.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_progress(self) -> bool:
        """Progress is a streaming feature: a non-streamed request ignores the option."""
        options = self.stream_options
        return self.stream and options is not None and options.include_progress


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


class TextPart(_Request):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names; it also keeps them plain in prompts and grammars.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments object
    strict: bool | None = None  # required/named choices always enforce the schema


class ChatTool(_Request):
    """One entry of `tools`. Only function tools exist in chat completions (check_fields
    refuses others, e.g. `custom`, by name)."""

    type: str
    function: FunctionDefinition | None = None


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; an object is taken as is


class MessageToolCall(_Request):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def check_fields(self, index: int) -> None:
        check_extra_fields(self.model_extra, MESSAGE_REFUSED, f"messages[{index}]", "messages")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # Tool calling (server/tool_calls, docs/api.md#tool-calling).
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_fields(self) -> None:
        check_extra_fields(self.model_extra, CHAT_REFUSED, "the request")
        for index, message in enumerate(self.messages):
            message.check_fields(index)
        for index, tool in enumerate(self.tools or ()):
            check_function_tool(index, tool.type, tool.function is not None, "function")


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM's: each token's string next to its id


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------


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
    num_tokens: int  # positions it computed (a prefill chunk's length, 1 in decode)
    prompt_tokens: int
    prompt_tokens_computed: int  # prompt tokens with K/V cached after this pass
    token_ids: list[int] = Field(default_factory=list)  # tokens this pass produced
    elapsed_seconds: float  # the request's arrival to the end of this pass (server clock)
    prefill_flops: float
    decode_flops: float
    prefill_cost_usd: float
    decode_cost_usd: float


def _unset(value: Any) -> bool:
    return value is None


# Present only on the chunks of a request that asked for progress.
ProgressField = Annotated[StreamProgress | None, Field(exclude_if=_unset)]


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
    list[dict[int, PromptLogprob] | None] | None, Field(exclude_if=_unset)
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is only tool calls
    # Present only when the output held calls (request with tools, tool_choice not none).
    tool_calls: Annotated[list[ResponseToolCall] | None, Field(exclude_if=_unset)] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...}; with tools, also
    # {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]} and
    # {"tool_calls": [{"index", "function": {"arguments": ...}}]} (OpenAI's delta shape).
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    meterserve: ProgressField = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "meterserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
