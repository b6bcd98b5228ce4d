"""tool_choice resolved and checked (400s naming the field), and the grammar behind required
and named choices: with the real SmolLM2 tokenizer, xgrammar's matcher accepts exactly the
hermes calls the parser reads, each function's arguments held to its schema."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from pydantic import ValidationError
from transformers import AutoTokenizer

from engine.loader import hf_checkpoint_dir
from server.http.errors import OpenAIError, validation_error
from server.openai.protocol import ChatCompletionRequest
from server.routes.chat import tool_policy_of
from server.tool_calls import (
    FunctionTool,
    ToolChoice,
    parse_tool_calls,
    resolve_tool_policy,
    tool_call_constraint,
)
from server.tool_calls.prompt import call_text

WEATHER = FunctionTool(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
)
ADD = FunctionTool(
    "add",
    None,
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
)
TOOLS = [WEATHER, ADD]


def _chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}]} | fields
    try:  # as server/http/body.py parses a request
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check_fields()
    return request


def _raises(param: str, call) -> OpenAIError:
    with pytest.raises(OpenAIError) as raised:
        call()
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message
    return raised.value


def test_tool_choice_defaults_to_auto_with_tools_and_none_without():
    assert resolve_tool_policy(TOOLS, None, None).mode == "auto"
    assert resolve_tool_policy([], None, None).mode == "none"
    assert resolve_tool_policy([], ToolChoice("none"), False).mode == "none"
    policy = resolve_tool_policy(TOOLS, ToolChoice("named", "add"), None)
    assert policy.forced_tools == (ADD,) and policy.max_calls == 1
    assert resolve_tool_policy(TOOLS, ToolChoice("required"), False).max_calls == 1
    assert resolve_tool_policy(TOOLS, ToolChoice("required"), None).max_calls is None
    assert not resolve_tool_policy(TOOLS, ToolChoice("none"), None).parses_calls


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        ([], ToolChoice("required"), "tool_choice", "only allowed when tools"),
        ([], ToolChoice("auto"), "tool_choice", "only allowed when tools"),
        (TOOLS, ToolChoice("named", "nope"), "tool_choice", "'nope', which is not in tools"),
        ([ADD, ADD], None, "tools", "more than one function named add"),
        ([FunctionTool("f", None, {"type": "array"})], None, "tools", "type object"),
    ],
)
def test_inconsistent_tools_are_a_400_naming_the_field(tools, choice, param, words):
    error = _raises(param, lambda: resolve_tool_policy(tools, choice, None))
    assert words in error.message


def test_the_chat_request_shape_becomes_a_policy():
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD.parameters}}]
    named = {"type": "function", "function": {"name": "add"}}
    policy = tool_policy_of(_chat(tools=tools, tool_choice=named, parallel_tool_calls=False))
    assert policy.mode == "named" and policy.name == "add" and not policy.parallel
    assert policy.tools == (FunctionTool("add", None, ADD.parameters),)
    _raises(
        "tool_choice",
        lambda: tool_policy_of(
            _chat(tools=tools, tool_choice={**named, "function": {"name": "x"}})
        ),
    )


@pytest.mark.parametrize(
    ("tool", "words"),
    [
        ({"type": "custom", "custom": {"name": "x"}}, "only function tools"),
        ({"type": "function"}, "needs `function`"),
        ({"type": "function", "function": {"name": "has space"}}, "pattern"),
    ],
)
def test_tools_other_than_functions_are_refused(tool, words):
    error = _raises("tools", lambda: _chat(tools=[tool]))
    assert words in error.message


def test_the_deprecated_functions_fields_stay_refused():
    _raises("functions", lambda: _chat(functions=[{"name": "f"}]))
    _raises("function_call", lambda: _chat(function_call={"name": "f"}))


def test_auto_and_none_are_not_constrained():
    for mode in ("auto", "none"):
        assert tool_call_constraint(resolve_tool_policy(TOOLS, ToolChoice(mode), None)) is None


def test_a_schema_xgrammar_cannot_enforce_is_a_400_naming_tools():
    bad = FunctionTool("f", None, {"type": "object", "properties": {"n": {"type": "nope"}}})
    policy = resolve_tool_policy([bad], ToolChoice("required"), None)
    error = _raises("tools", lambda: tool_call_constraint(policy))
    assert (
        'Unsupported type "nope"' in error.message and "json_schema_converter" not in error.message
    )


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(hf_checkpoint_dir("default"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )
    return xgr.GrammarCompiler(info, max_threads=1)


def _accepts(compiler, tokenizer, policy, text: str) -> bool:
    """Whether the policy's grammar takes `text` and then ends (EOS)."""
    constraint = tool_call_constraint(policy)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_ebnf(constraint.spec)))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


PARIS = call_text("get_weather", {"city": "Paris", "unit": "c"})
ONE = call_text("add", {"a": 1})


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "accepted"),
    [
        (ToolChoice("named", "get_weather"), None, PARIS, True),
        (ToolChoice("named", "get_weather"), None, PARIS.replace(', "unit": "c"', ""), False),
        (ToolChoice("named", "get_weather"), None, PARIS.replace('"c"', '"k"'), False),
        (ToolChoice("named", "get_weather"), None, ONE, False),
        (ToolChoice("named", "get_weather"), None, f"Sure. {PARIS}", False),
        (ToolChoice("named", "get_weather"), None, f"{PARIS}\n{PARIS}", False),
        (ToolChoice("required"), None, ONE, True),
        # Calls follow each other with no separator, and the turn may end after any of them.
        (ToolChoice("required"), None, f"{PARIS}{ONE}{ONE}", True),
        (ToolChoice("required"), None, f"{PARIS}\n{ONE}", False),
        (ToolChoice("required"), None, f"{ONE}\n", False),
        (ToolChoice("required"), False, f"{PARIS}{ONE}", False),
        (ToolChoice("required"), None, "no call", False),
        (ToolChoice("required"), None, "", False),
        (
            ToolChoice("required"),
            None,
            '<tool_call>\n{"name": "add", "arguments": {"a":  1}}\n</tool_call>',
            False,
        ),
    ],
)
def test_the_grammar_takes_exactly_the_calls_it_should(
    compiler, tokenizer, choice, parallel, text, accepted
):
    policy = resolve_tool_policy(TOOLS, choice, parallel)
    assert _accepts(compiler, tokenizer, policy, text) == accepted
    if accepted:  # what the grammar allows, the parser reads as calls, all of it
        parsed = parse_tool_calls(text, policy.max_calls)
        assert parsed.content is None and len(parsed.tool_calls) == text.count("<tool_call>")
