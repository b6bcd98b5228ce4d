"""vLLM's older guided_* fields: each is the same constraint as its structured_outputs
spelling; what cannot be honoured, and two constraints at once, are 400s naming the field."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from engine.structured_output import CompiledConstraint, StructuredOutputError, grammar_of
from scheduler.sampling_params import StructuredOutput
from server.http.errors import OpenAIError
from server.openai.guided_decoding import guided_constraint
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.structured_output_fields import structured_output_of

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
GRAMMAR = 'root ::= "yes" | "no"'


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


class _Structured:
    """The engine's compile worker, answering at once (what is compiled is recorded)."""

    def __init__(self) -> None:
        self.asked: list[StructuredOutput] = []

    def compile_async(self, constraint: StructuredOutput) -> Future:
        self.asked.append(constraint)
        future: Future = Future()
        try:
            future.set_result(CompiledConstraint(grammar_of(constraint), 0.0))
        except StructuredOutputError as exc:
            future.set_exception(exc)
        return future


def _constraint(body) -> StructuredOutput | None:
    client = SimpleNamespace(structured=_Structured())
    return asyncio.run(structured_output_of(body, client))


@pytest.mark.parametrize(
    ("guided", "vllm"),
    [
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_json": '{"type": "integer"}'}, {"json": '{"type": "integer"}'}),
        ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
        ({"guided_choice": ["red", "green"]}, {"choice": ["red", "green"]}),
        ({"guided_grammar": GRAMMAR}, {"grammar": GRAMMAR}),
        ({"guided_json_object": True}, {"json_object": True}),
    ],
)
def test_each_guided_field_is_its_structured_outputs_constraint(guided, vllm):
    expected = _constraint(_chat(structured_outputs=vllm))
    assert expected is not None
    assert _constraint(_chat(**guided)) == expected
    assert _constraint(CompletionRequest.model_validate({"prompt": "x", **guided})) == expected
    assert guided_constraint(_chat(**guided)).param == next(iter(guided))


def test_no_guided_field_and_no_op_values_are_no_constraint():
    assert _constraint(_chat()) is None
    assert _constraint(_chat(guided_json_object=False, guided_decoding_backend="auto")) is None
    # the backend that runs anyway
    assert _constraint(_chat(guided_regex="a+", guided_decoding_backend="xgrammar")) is not None


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "not several"),
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}},
         "guided_json", "not both"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "not both"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": r"[ ]?"},
         "guided_whitespace_pattern", "not supported"),
        ({"structural_tag": "{}"}, "structural_tag", "not supported"),
        ({"guided_grammar": "root ::= nothing_defined"},
         "guided_grammar", "invalid guided_grammar"),
        ({"guided_choice": []}, "guided_choice", "at least one"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as raised:
        _constraint(_chat(**fields))
    assert raised.value.status == 400 and raised.value.param == param
    assert words in raised.value.message
