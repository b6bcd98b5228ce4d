"""The request fields chat completions and completions share (sampling, stop, stream options,
structured outputs, vLLM's extensions), and the strict base every request model extends."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema

from scheduler.logit_bias import LogitBias
from server.openai.fields import check_extra_fields
from server.openai.request_limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    parse_logit_bias,
)

MAX_TOP_LOGPROBS = 20

# OpenAI's {"token id": bias} object, parsed once while the body is validated (server/http/body.py
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


class RequestModel(BaseModel):
    # extra="allow": the fields we do not model are kept, so check_fields() can refuse the
    # OpenAI ones we do not honour by name instead of dropping them.
    model_config = ConfigDict(strict=True, extra="allow")

    def check_fields(self) -> None:
        """400 for a refused OpenAI field; log the ones OpenAI does not define."""
        check_extra_fields(self.model_extra, {}, type(self).__name__)


class StreamOptions(RequestModel):
    include_usage: bool = False
    # meterserve extension (docs/api.md, docs/console.md): each chunk carries a `meterserve`
    # object saying which forward pass produced it, plus progress-only chunks for prefill
    # chunks that sample nothing.
    include_progress: bool = False


class JsonSchemaFormat(RequestModel):
    """OpenAI's response_format.json_schema; the schema is always enforced (strict or not)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(RequestModel):
    """vLLM's structured_outputs: exactly one constraint. Options of vLLM's we do not model
    are a 400 here (extra="forbid"), not dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(RequestModel):
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
    # vLLM's text extensions (server/text/detokenizer.py): show the matched stop string, and keep
    # or drop special tokens' text.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's extension: lower runs first (--scheduling-policy priority)
    logit_bias: LogitBiasField = None
    cache_salt: CacheSalt | None = None
    # Structured outputs (server/openai/structured_output_fields.py): OpenAI's response_format,
    # or vLLM's structured_outputs extension; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older spelling of structured_outputs (server/openai/guided_decoding.py): aliases, or a
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
