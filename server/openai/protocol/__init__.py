"""OpenAI request/response models (pydantic, the HTTP edge only), one module per endpoint
family: request_fields (shared by chat and completions), response_fields (usage, progress),
chat, completions, tokenize, models; the Responses API's are in responses (request) and
responses_output (response), imported from there.

Requests are strict (a string where a number belongs is a 400, not coerced). Every field
OpenAI defines is honoured, refused with a 400 naming it, or accepted and ignored because it
cannot change the output (server/openai/fields.py, docs/api.md); fields OpenAI does not
define are ignored with a log warning, as vLLM does. Range checks live in one place,
`SamplingParams`, except the few that only the HTTP layer knows (n, logprobs counts, prompt
shape).
"""

from __future__ import annotations

from server.openai.protocol.chat import (
    FUNCTION_NAME_PATTERN,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChatTool,
    FunctionDefinition,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseToolCall,
    TextPart,
    ToolCallFunction,
    TopLogprob,
)
from server.openai.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptInput,
    PromptLogprob,
    PromptLogprobsField,
)
from server.openai.protocol.models import (
    ModelCard,
    ModelList,
)
from server.openai.protocol.request_fields import (
    MAX_TOP_LOGPROBS,
    CacheSalt,
    JsonSchemaFormat,
    LogitBiasField,
    RequestModel,
    ResponseFormat,
    SamplingFields,
    StopString,
    StreamOptions,
    StructuredOutputsParams,
)
from server.openai.protocol.response_fields import (
    ProgressField,
    PromptTokensDetails,
    StreamProgress,
    Usage,
    dump,
)
from server.openai.protocol.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
)

__all__ = [
    "FUNCTION_NAME_PATTERN",
    "MAX_TOP_LOGPROBS",
    "AssistantMessage",
    "CacheSalt",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "ChatTool",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "FunctionDefinition",
    "JsonSchemaFormat",
    "LogitBiasField",
    "MessageToolCall",
    "ModelCard",
    "ModelList",
    "NamedFunction",
    "NamedToolChoice",
    "ProgressField",
    "PromptInput",
    "PromptLogprob",
    "PromptLogprobsField",
    "PromptTokensDetails",
    "RequestModel",
    "ResponseFormat",
    "ResponseFunctionCall",
    "ResponseToolCall",
    "SamplingFields",
    "StopString",
    "StreamOptions",
    "StreamProgress",
    "StructuredOutputsParams",
    "TextPart",
    "TokenizeRequest",
    "ToolCallFunction",
    "TopLogprob",
    "Usage",
    "dump",
]
