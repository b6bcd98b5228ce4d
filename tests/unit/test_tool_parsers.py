"""Each tool-call format (server/tool_parsers) on model outputs written from the families'
published formats: calls and content parsed whole, the same from the stream parser at every
chunk boundary (two pieces at each split, three for short outputs, one character at a
time), malformed outputs left as content; auto picks the format from template text."""

from __future__ import annotations

import json

import pytest

from server.settings import Settings
from server.tool_calls import FunctionTool
from server.tool_parsers import (
    FORMATS,
    CallDelta,
    ContentDelta,
    auto_format_name,
    stream_update,
    tool_call_format,
)

TOOLS = (
    FunctionTool(
        "get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    ),
    FunctionTool("add", parameters={"type": "object", "properties": {"a": {"type": "number"}}}),
)
PARIS = ("get_weather", {"city": "Paris"})
PARIS_3 = ("get_weather", {"city": "Paris", "days": 3})
ADD = ("add", {"a": 1.5})

QWEN_PARIS = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)
QWEN_ADD = (
    "<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n</function>\n</tool_call>"
)
HERMES_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# format -> [(output, content, calls)]
FIXTURES: dict[str, list[tuple[str, str | None, list]]] = {
    "hermes": [
        (HERMES_PARIS, None, [PARIS]),
        (f"Let me check.\n{HERMES_PARIS}\n", "Let me check.", [PARIS]),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"name": "add", "arguments": {"a": 1.5', '<tool_call>{"name": "add", "arguments": {"a": 1.5', []),
    ],
    "qwen3_coder": [
        (QWEN_PARIS, None, [PARIS]),
        (
            (
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
            ),
            None,
            [PARIS_3],
        ),
        (f"Sure.\n{QWEN_PARIS}\n{QWEN_ADD}", "Sure.", [PARIS, ADD]),
        # cut after the last parameter: still a call
        ("<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n", None, [ADD]),
        # text between parameters, or no function: content
        (
            "<tool_call>\n<function=add>\nhmm <parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
            "<tool_call>\n<function=add>\nhmm <parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
            [],
        ),
        ("<tool_call>\nadd(1)\n</tool_call>", "<tool_call>\nadd(1)\n</tool_call>", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [PARIS_3]),
        ('\n{"name": "get_weather", "arguments": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1.5}}', None, [PARIS, ADD]),
        ('{"name": "add", "parameters": {"a": 1.5}}{"name": "add", "parameters": {"a": 1.5}}', None, [ADD, ADD]),
        ("The weather is {sunny}.", "The weather is {sunny}.", []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ('{"name": "add", "parameters": {"a": 1.5}} and more', '{"name": "add", "parameters": {"a": 1.5}} and more', []),
        ('  {"name": "add", "param', '  {"name": "add", "param', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
        (
            (
                'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": "{\\"a\\": 1.5}"}]'
            ),
            "Checking.",
            [PARIS, ADD],
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add{"a": 1.5}', None, [PARIS, ADD]),
        ("No tools [TOOL_CALL] here", "No tools [TOOL_CALL] here", []),
        ("x [TOOL_CALLS][{oops}]", "x [TOOL_CALLS][{oops}]", []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris")]', None, [PARIS]),
        ('[get_weather(city="Paris", days=3), add(a=1.5)]', None, [PARIS_3, ADD]),
        ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [PARIS]),
        ("[add(a=1.5)]\n", None, [ADD]),
        ('[f(x=true, y=null, z={"k": [1, False]})]', None, [("f", {"x": True, "y": None, "z": {"k": [1, False]}})]),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[add(1.5)]", "[add(1.5)]", []),
        ("[add(a=__import__('os'))]", "[add(a=__import__('os'))]", []),
        ("Hello [add(a=1)]", "Hello [add(a=1)]", []),
        ("[add(a=1.5)", "[add(a=1.5)", []),
    ],
}  # fmt: skip
CASES = [(name, *case) for name, cases in FIXTURES.items() for case in cases]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_a_whole_output_parses_to_its_calls_and_content(name, output, content, calls):
    parsed = tool_call_format(name, None, TOOLS).parse(output)
    assert parsed.content == content and _calls(parsed.tool_calls) == calls
    assert len({call.id for call in parsed.tool_calls}) == len(calls)


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    if len(text) <= 80:
        for i in range(1, len(text)):
            for j in range(i + 1, len(text)):
                yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("max_calls", [None, 1])
@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_every_chunking_streams_the_whole_parse(name, output, content, calls, max_calls):
    fmt = tool_call_format(name, None, TOOLS)
    whole = fmt.parse(output, max_calls)
    assert len(whole.tool_calls) == min(len(calls), max_calls or len(calls))
    for pieces in _splits(output):
        parser = fmt.stream(max_calls)
        deltas = []
        for k, piece in enumerate(pieces):
            deltas += stream_update(parser, piece, finished=k == len(pieces) - 1)
        text = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        call_deltas = [d for d in deltas if isinstance(d, CallDelta)]
        assert text == (whole.content or ""), pieces
        assert _calls(d.call for d in call_deltas) == _calls(whole.tool_calls), pieces
        assert [d.index for d in call_deltas] == list(range(len(call_deltas)))
        assert parser.num_calls == len(calls)
        assert all(d.text for d in deltas if isinstance(d, ContentDelta))


def test_content_streams_before_the_calls_are_known():
    parser = tool_call_format("mistral", None, TOOLS).stream()
    assert parser.feed("Checking the ") == [ContentDelta("Checking the")]
    assert parser.feed("weather [TOOL") == [ContentDelta(" weather")]
    assert parser.feed('_CALLS][{"name": "add", "arguments": {}}]') == []
    [call] = parser.finish()
    assert isinstance(call, CallDelta) and call.call.name == "add"
    llama = tool_call_format("llama3_json", None, TOOLS).stream()
    assert llama.feed("  ") == [] and llama.feed("It is") == [ContentDelta("  It is")]
    assert llama.feed(' {"name": "add"}') == [ContentDelta(' {"name": "add"}')]


def test_qwen3_coder_reads_values_by_the_tools_schema():
    fmt = tool_call_format("qwen3_coder", None, TOOLS)
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\nthree\n</parameter>\n<parameter=extra>\n[1]\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    [call] = fmt.parse(text).tool_calls
    # city is a string (kept as text), days an integer that is not JSON (kept as text),
    # extra is not in the schema (text)
    assert json.loads(call.arguments) == {"city": "42", "days": "three", "extra": "[1]"}


TEMPLATES = {
    "hermes": "{% for tool in tools %}...<tool_call>\n{{ tool | tojson }}</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>",
    "mistral": "{%- if message.tool_calls %}[TOOL_CALLS][{% for tool in message.tool_calls %}",
    "pythonic": "[func_name1(params_name1=params_value1, params_name2=params_value2...)]",
    "llama3_json": '{"name": function name, "parameters": dictionary of argument name and its '
    "value}<|python_tag|>",
}


@pytest.mark.parametrize(("name", "template"), TEMPLATES.items())
def test_auto_picks_the_format_the_template_shows(name, template):
    assert auto_format_name(template) == name
    assert tool_call_format("auto", template).name == name


def test_auto_falls_back_to_hermes_and_every_format_is_listed():
    assert auto_format_name(None) == auto_format_name("{{ messages }}") == "hermes"
    assert set(FORMATS) == {"hermes", "qwen3_coder", "llama3_json", "mistral", "pythonic"}


def test_the_flag_chooses_the_parser_vllms_way():
    assert Settings.from_args([], environ={}).tool_call_parser == "hermes"
    chosen = Settings.from_args(
        ["--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"], environ={}
    )
    assert chosen.tool_call_parser == "qwen3_coder"
    env = {"METERSERVE_TOOL_CALL_PARSER": "auto"}
    assert Settings.from_args([], environ=env).tool_call_parser == "auto"
    with pytest.raises(SystemExit):
        Settings.from_args(["--tool-call-parser", "granite"], environ={})
