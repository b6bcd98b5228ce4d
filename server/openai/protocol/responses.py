"""OpenAI Responses API models (`POST /v1/responses`, pydantic, the HTTP edge only).

A Responses request becomes a chat request: `instructions` and `input` become chat messages
(`messages()`), and the sampling fields become the `SamplingFields` every generation route
builds its engine requests from (`sampling_fields()`), so the Responses API runs the chat
path unchanged. meterserve is stateless: nothing is stored, `previous_response_id` and
`conversation` are refused, and every response says `"store": false` whatever the request
asked (OpenAI's default is to store; vLLM accepts `store` too).

The response models are server/openai/protocol/responses_output.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from server.http.errors import bad_request
from server.openai.fields import (
    RESPONSES_EXTENSIONS_REFUSED,
    RESPONSES_IGNORED,
    RESPONSES_REFUSED,
    RESPONSES_TEXT_REFUSED,
    check_extra_fields,
)
from server.openai.protocol.chat import (
    FUNCTION_NAME_PATTERN,
    ChatMessage,
    MessageToolCall,
    ToolCallFunction,
)
from server.openai.protocol.request_fields import (
    CacheSalt,
    JsonSchemaFormat,
    LogitBiasField,
    ResponseFormat,
    SamplingFields,
)
from server.openai.request_limits import MAX_TOOLS
from server.tool_calls import FunctionTool, ToolChoice
from server.tool_calls.tools import check_function_tool

# Fields that need stored state; named in their own 400 rather than the generic one.
STATEFUL_FIELDS = ("previous_response_id", "conversation")


class _Request(BaseModel):
    # Strict like every request model (server/openai/protocol/request_fields.py); extra="allow"
    # keeps the fields we do not model so check_fields() can refuse the ones we do not honour by
    # name.
    model_config = ConfigDict(strict=True, extra="allow")


class InputTextPart(_Request):
    """A text part of an input message: `input_text`, or `output_text` when an earlier
    response's output is sent back as input (its annotations and logprobs are not used)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _joined(value: str | list[InputTextPart]) -> str:
    """A text field that may also come as a list of input_text parts."""
    return value if isinstance(value, str) else "".join(part.text for part in value)


class InputMessage(_Request):
    """One message item of `input` (`type` may be left out, as the SDK's EasyInputMessage
    does). `id` and `status` come back with an earlier response's output item; unused."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Request):
    """A call the model made in an earlier turn (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.output)


def _item_type(item: Any) -> str:
    """A message item may leave `type` out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionToolParam(_Request):
    """One entry of `tools`, in the Responses API's flat shape. Only function tools are
    supported (check_fields refuses others, e.g. `web_search`, by name)."""

    type: str
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """`text.format`: Responses' flat spelling of chat's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs `schema`")
        return self

    def response_format(self) -> ResponseFormat | None:
        """The chat response_format that enforces this format (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        schema = JsonSchemaFormat.model_validate(
            {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        )
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    # Tool calling (server/tool_calls), as on chat.
    tools: Annotated[list[FunctionToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions on its Responses API, as on chat (docs/api.md).
    top_k: int | None = None
    logit_bias: LogitBiasField = None
    cache_salt: CacheSalt | None = None
    priority: int = 0
    skip_special_tokens: bool = True

    def check_fields(self) -> None:
        """400 for a refused field (a stateful one with its own message); log the fields
        OpenAI does not define."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in RESPONSES_IGNORED}
        for name in STATEFUL_FIELDS:
            if extra.get(name) is not None:
                raise bad_request(
                    f"{name} is not supported: meterserve is stateless and stores no responses "
                    "or conversations; send the whole conversation in `input`",
                    param=name,
                    code="unsupported_parameter",
                )
        refused = {**RESPONSES_REFUSED, **RESPONSES_EXTENSIONS_REFUSED}
        check_extra_fields(extra, refused, "the request")
        if self.text is not None:
            check_extra_fields(self.text.model_extra, RESPONSES_TEXT_REFUSED, "text", "text")
        for index, tool in enumerate(self.tools or ()):
            check_function_tool(index, tool.type, tool.name is not None, "name")

    def function_tools(self) -> list[FunctionTool]:
        return [
            FunctionTool(tool.name, tool.description, tool.parameters, tool.strict)
            for tool in self.tools or ()
            if tool.name is not None  # check_fields refused the others
        ]

    def tool_choice_value(self) -> ToolChoice | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if isinstance(choice, str):
            return ToolChoice(choice)
        return ToolChoice("named", choice.name)

    @property
    def format(self) -> TextFormat:
        if self.text is None or self.text.format is None:
            return TextFormat(type="text")
        return self.text.format

    def messages(self) -> list[ChatMessage]:
        """The chat conversation: `instructions` as the first (system) message, then `input`
        (a string is one user message). A function_call item joins the assistant turn just
        before it (Responses keeps an answer's text and calls as separate items; chat, as
        one assistant message), and a function_call_output is a `tool` message."""
        turns = []
        if self.instructions is not None:
            turns.append(ChatMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            return [*turns, ChatMessage(role="user", content=self.input)]
        for item in self.input:
            if isinstance(item, InputMessage):
                turns.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(
                    ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id)
                )
            else:
                call = MessageToolCall(
                    id=item.call_id,
                    function=ToolCallFunction(name=item.name, arguments=item.arguments),
                )
                if not turns or turns[-1].role != "assistant":
                    turns.append(ChatMessage(role="assistant", content=None))
                turns[-1].tool_calls = [*(turns[-1].tool_calls or []), call]
        return turns

    def sampling_fields(self) -> SamplingFields:
        """The chat sampling fields this request means (n is always 1)."""
        return SamplingFields(
            model=self.model,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            logit_bias=self.logit_bias,
            cache_salt=self.cache_salt,
            priority=self.priority,
            skip_special_tokens=self.skip_special_tokens,
            stream=self.stream,
            response_format=self.format.response_format(),
        )
