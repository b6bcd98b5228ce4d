"""The serving core: the one request pipeline of every generation endpoint (chat completions,
completions, Responses), as vLLM's `OpenAIServing` base serves its endpoints.

An endpoint parses its protocol into a `GenerationJob`; the core runs the shared steps:

    open:    read the body (server/http/body.py) -> 503 until the engine is ready -> check the model
    start:   check choices, stop strings, priority -> the tool-call format and the one output
             constraint (structured output or forced tools), compiled ahead -> the chat
             template or the tokenizer (off the event loop when long) -> max_tokens per
             prompt, SamplingParams once per request -> submit -> a Generation over the group
    respond: stream the endpoint's builder as SSE, or run the generation to the end and answer
             once; either way the group is released when the response ends, fails or the
             client leaves

An endpoint keeps only its protocol parsing (its request model into a GenerationJob) and its
output building (a `ResponseBuilder`: chunks and the final response object).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from scheduler.sampling_params import SamplingParams, StructuredOutput
from server.app_state import (
    billing_account,
    engine_cache_salt,
    get_settings,
    ready_client,
    served_model_names,
    token_texts,
    tool_format,
)
from server.engine_client.client import EngineClient
from server.engine_client.request_group import EngineRequestSpec, RequestGroup
from server.http.body import parse_request
from server.http.sse import SSEResponse
from server.openai.generation import ClientDisconnected, Generation, until_disconnected
from server.openai.prompts import apply_chat_template, num_prompts, tokenize_prompts
from server.openai.protocol import ChatMessage, PromptInput, SamplingFields, dump
from server.openai.request_limits import check_num_choices
from server.openai.request_params import (
    build_sampling_params,
    check_model,
    check_priority,
    check_stop_strings,
    choice_params,
    resolve_max_tokens,
    text_options,
    tool_text_options,
    with_max_tokens,
)
from server.openai.structured_output_fields import structured_output_of
from server.settings import Settings
from server.text.detokenizer import TokenTexts
from server.tool_calls import ToolCallFormat, ToolPolicy, output_constraint

Body = TypeVar("Body")

NO_TOOLS = ToolPolicy()  # an endpoint without tools (completions)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation the chat template renders (chat completions, Responses)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """Completions' prompt: a string, strings, token ids or lists of token ids."""

    prompt: PromptInput


@dataclass(frozen=True, slots=True)
class GenerationJob:
    """What an endpoint asks the core to run, its protocol parsed. `fields` are the sampling
    fields (a Responses request's converted to chat's); `max_tokens` is as asked (None: the
    endpoint's `default_max_tokens`, or the rest of the context when that is None too)."""

    request_id: str
    fields: SamplingFields
    prompt: ChatPrompt | TextPrompt
    max_tokens: int | None
    n: int = 1
    logprobs: int | None = None  # top-k logprobs of each output token (None: none)
    prompt_logprobs: int | None = None  # top-k at each prompt position (None: none)
    default_max_tokens: int | None = None
    tools: ToolPolicy = NO_TOOLS

    @property
    def prompt_param(self) -> str:
        """The parameter a 400 about the prompt names."""
        return "prompt" if isinstance(self.prompt, TextPrompt) else "messages"


@dataclass(frozen=True, slots=True)
class Submitted:
    """A job's engine requests, admitted: choice i belongs to prompt i // n."""

    request_id: str
    group: RequestGroup
    generation: Generation
    params: SamplingParams  # choice 0's (the others differ in seed or max_tokens only)
    tools: ToolPolicy
    fmt: ToolCallFormat  # the format calls are parsed in (when tools.parses_calls)
    prompts: list[list[int]]


class ResponseBuilder(Protocol):
    """Turns one Generation into SSE events or one response body (an endpoint's output)."""

    def events(self, include_usage: bool) -> AsyncIterator[str]: ...

    def response(self) -> Any: ...


class OpenAIServing:
    """One HTTP request on its way through the pipeline: the settings, the ready engine
    client and the model id it answers as."""

    def __init__(
        self, request: Request, settings: Settings, client: EngineClient, model: str
    ) -> None:
        self.request = request
        self.settings = settings
        self.client = client
        self.model = model

    @classmethod
    async def open(cls, request: Request, body_type: type[Body]) -> tuple[OpenAIServing, Body]:
        """The request's body as `body_type` (400 or 413), once the engine is ready (503) and
        the model is one this server serves (404)."""
        settings = get_settings(request)
        body = await parse_request(request, body_type, settings.max_request_body_bytes)
        client = ready_client(request)
        model = check_model(body.model, served_model_names(request))  # type: ignore[attr-defined]
        return cls(request, settings, client, model), body

    @property
    def token_texts(self) -> TokenTexts:
        return token_texts(self.request)

    async def start(self, job: GenerationJob) -> Submitted:
        """Check the job, build its engine requests and submit them (400s name the field;
        429/503 from admission)."""
        settings, client, fields = self.settings, self.client, job.fields
        count = num_prompts(job.prompt.prompt) if isinstance(job.prompt, TextPrompt) else 1
        check_num_choices(count, job.n, settings.max_choices_per_request, job.prompt_param)
        stop = check_stop_strings(fields.stop_strings)
        priority = check_priority(fields.priority, settings.engine.scheduling_policy)
        fmt = tool_format(self.request, job.tools.tools)
        structured_output = await structured_output_of(fields, client)  # 400: does not compile
        # required / named tool_choice: a grammar, so calls always parse
        structured_output = await output_constraint(structured_output, job.tools, client, fmt)
        prompts = await self._prompts(job)
        specs, params = self._specs(job, prompts, priority, structured_output)
        group = client.submit(specs, billing_account(self.request))
        options = tool_text_options(text_options(fields, stop), fmt, job.tools)
        generation = Generation(client, group, prompts, job.n, options)
        return Submitted(job.request_id, group, generation, params, job.tools, fmt, prompts)

    async def _prompts(self, job: GenerationJob) -> list[list[int]]:
        if isinstance(job.prompt, TextPrompt):
            return await tokenize_prompts(job.prompt.prompt, self.client)
        chat = job.prompt
        tools = job.tools.tools
        return [
            await apply_chat_template(self.client, chat.messages, chat.add_generation_prompt, tools)
        ]

    def _specs(
        self,
        job: GenerationJob,
        prompts: list[list[int]],
        priority: int,
        structured_output: StructuredOutput | None,
    ) -> tuple[list[EngineRequestSpec], SamplingParams]:
        """n engine requests per prompt; SamplingParams built once (other prompts differ in
        max_tokens, other choices in seed)."""
        client = self.client
        salt = engine_cache_salt(self.request, job.fields.cache_salt)
        params: SamplingParams | None = None
        specs: list[EngineRequestSpec] = []
        for p_index, prompt in enumerate(prompts):
            max_tokens = resolve_max_tokens(
                job.max_tokens,
                len(prompt),
                client.max_request_tokens,
                job.default_max_tokens,
                job.prompt_param,
            )
            if params is None:
                params = build_sampling_params(
                    job.fields,
                    max_tokens=max_tokens,
                    logprobs=job.logprobs,
                    vocab_size=client.vocab_size,
                    tokenizer=client.tokenizer,
                    prompt_logprobs=job.prompt_logprobs,
                    structured_output=structured_output,
                )
            for choice in choice_params(with_max_tokens(params, max_tokens), job.n):
                choice_id = f"{job.request_id}-{len(specs)}"
                specs.append(EngineRequestSpec(choice_id, prompt, choice, p_index, priority, salt))
        assert params is not None  # tokenize_prompts refuses an empty prompt list
        return specs, params

    async def respond(
        self,
        submitted: Submitted,
        builder: ResponseBuilder,
        stream: bool,
        include_usage: bool,
        done: bool = True,
    ) -> Response:
        """Stream the generation as SSE (`data: [DONE]` last unless `done` is false), or run it
        to the end and answer once. Either way the group is released when the response ends,
        fails or the client leaves (a non-streaming client that disconnects gets a 499 that
        nobody reads)."""
        group = submitted.group

        def release() -> None:
            self.client.release(group)

        if stream:
            return SSEResponse(builder.events(include_usage), release, done)
        try:
            await until_disconnected(self.request, submitted.generation.run())
            body = dump(builder.response())  # before the release: it may relabel finishes
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            release()
        return JSONResponse(body)
