"""The HTTP side of structured outputs: a constraint is compiled ahead on the engine's compile
worker before the request is submitted (400s naming the field for an over-size spec, a
grammar that does not compile, a compile that takes too long), and the compile seconds are
billed to the request that asked for them, once."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

import server.openai.grammar_compile as grammar_compile_module
from engine.loader import hf_checkpoint_dir
from engine.meter.billing import Prices
from engine.structured_output import CompiledConstraint, StructuredOutputError, StructuredOutputs
from scheduler.sampling_params import SamplingParams, StructuredOutput
from server.engine_client.request_group import BillingAccount, EngineRequestSpec, RequestGroup
from server.http.errors import OpenAIError
from server.openai.grammar_compile import MAX_GRAMMAR_SPEC_CHARS
from server.openai.protocol import ChatCompletionRequest
from server.openai.structured_output_fields import structured_output_of
from server.tool_calls import FunctionTool, ToolChoice, output_constraint, resolve_tool_policy

ACCOUNT = BillingAccount("acme", Prices(1.0, 4.0))
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


class _FakeStructured:
    """Stands in for the engine's StructuredOutputs: answers every compile with `future`."""

    def __init__(self, future: Future | None = None) -> None:
        self.future = future
        self.asked: list[StructuredOutput] = []

    def compile_async(self, constraint: StructuredOutput) -> Future:
        self.asked.append(constraint)
        assert self.future is not None, "nothing should have been compiled"
        return self.future


def _done(result: CompiledConstraint | None = None, error: Exception | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _group() -> RequestGroup:
    return RequestGroup([EngineRequestSpec("r-0", [1, 2, 3], SamplingParams())], None, ACCOUNT)


async def test_a_spec_over_the_limit_is_a_400_naming_its_field_before_any_compile():
    huge = {"type": "object", "description": "x" * MAX_GRAMMAR_SPEC_CHARS}
    client = SimpleNamespace(structured=_FakeStructured())
    for fields, param in (
        ({"response_format": _json_schema(huge)}, "response_format"),
        ({"structured_outputs": {"json": huge}}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a" * (MAX_GRAMMAR_SPEC_CHARS + 1)}},
            "structured_outputs",
        ),
    ):
        with pytest.raises(OpenAIError) as error:
            await structured_output_of(_chat(**fields), client)
        assert error.value.status == 400 and error.value.param == param
        assert f"at most {MAX_GRAMMAR_SPEC_CHARS}" in error.value.message
    assert client.structured.asked == []


async def test_a_compile_error_or_timeout_is_a_400_naming_the_field(monkeypatch):
    body = _chat(response_format=_json_schema(SCHEMA))
    failed = SimpleNamespace(structured=_FakeStructured(_done(error=StructuredOutputError("bad"))))
    with pytest.raises(OpenAIError) as error:
        await structured_output_of(body, failed)
    assert error.value.param == "response_format"
    assert error.value.message == "invalid response_format: bad"
    monkeypatch.setattr(grammar_compile_module, "GRAMMAR_COMPILE_TIMEOUT_S", 0.05)
    never: Future = Future()  # a compile still waiting in the worker's queue
    with pytest.raises(OpenAIError) as error:
        await structured_output_of(body, SimpleNamespace(structured=_FakeStructured(never)))
    assert error.value.param == "response_format" and "within 0.05 s" in error.value.message
    # Not cancelled: other requests may be waiting on the same compile; it goes on and is
    # cached for them.
    assert not never.cancelled()


async def test_the_compile_seconds_are_billed_once_to_the_group_submitted_next():
    compiled = CompiledConstraint(grammar=object(), compile_seconds=1.5)
    client = SimpleNamespace(structured=_FakeStructured(_done(compiled)))
    constraint = await structured_output_of(_chat(response_format=_json_schema(SCHEMA)), client)
    assert constraint == StructuredOutput("json_schema", json.dumps(SCHEMA))
    group = _group()
    assert group.grammar_compile_seconds == 1.5
    bill = group.bill(hardware_price_per_second=0.01)
    assert bill.grammar_compile_seconds == 1.5 and bill.cost_usd == pytest.approx(0.015)
    assert bill.busy_seconds == 0.0  # not engine time: no step ran it
    assert _group().grammar_compile_seconds == 0.0  # the next group of this task pays nothing


@pytest.fixture(scope="module")
def structured() -> StructuredOutputs:
    tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint_dir("default"))
    return StructuredOutputs(tokenizer, len(tokenizer))


async def test_a_real_compile_runs_on_the_worker_and_leaves_the_grammar_cached(structured):
    client = SimpleNamespace(structured=structured)
    loop_thread = threading.current_thread().name
    body = _chat(structured_outputs={"regex": "[0-9]{4}-[a-z]{2}"})
    constraint = await structured_output_of(body, client)
    assert constraint in structured.cache
    group = _group()
    assert group.grammar_compile_seconds > 0  # compiled for this request
    assert threading.current_thread().name == loop_thread
    await structured_output_of(body, client)
    assert _group().grammar_compile_seconds == 0.0  # a cache hit costs nothing


async def test_a_forced_tool_call_grammar_is_compiled_ahead_too(structured):
    client = SimpleNamespace(structured=structured)
    tool = FunctionTool("lookup", None, {"type": "object", "properties": {"q": {"type": "string"}}})
    policy = resolve_tool_policy([tool], ToolChoice("required"), None)
    constraint = await output_constraint(None, policy, client)
    assert constraint is not None and constraint in structured.cache
    assert _group().grammar_compile_seconds > 0
    big = {"type": "object", "description": "x" * MAX_GRAMMAR_SPEC_CHARS}
    too_big = resolve_tool_policy([FunctionTool("f", None, big)], ToolChoice("required"), None)
    with pytest.raises(OpenAIError) as error:
        await output_constraint(None, too_big, client)
    assert (
        error.value.param == "tools" and f"at most {MAX_GRAMMAR_SPEC_CHARS}" in error.value.message
    )
