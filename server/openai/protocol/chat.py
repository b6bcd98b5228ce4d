"""POST /v1/chat/completions' request and response models: messages, tools and tool_choice,
the assistant message with its tool calls, logprobs and streamed chunks."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from server.openai.fields import CHAT_REFUSED, MESSAGE_REFUSED, check_extra_fields
from server.openai.protocol.request_fields import MAX_TOP_LOGPROBS, RequestModel, SamplingFields
from server.openai.protocol.response_fields import ProgressField, Usage, is_unset
from server.openai.request_limits import MAX_TOOLS
from server.tool_calls.tools import check_function_tool


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names; it also keeps them plain in prompts and grammars.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments object
    strict: bool | None = None  # required/named choices always enforce the schema


class ChatTool(RequestModel):
    """One entry of `tools`. Only function tools exist in chat completions (check_fields
    refuses others, e.g. `custom`, by name)."""

    type: str
    function: FunctionDefinition | None = None


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(RequestModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; an object is taken as is


class MessageToolCall(RequestModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
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
    tool_calls: Annotated[list[ResponseToolCall] | None, Field(exclude_if=is_unset)] = None


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
