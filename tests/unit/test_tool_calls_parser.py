"""The hermes tool-call parser, whole and streamed: calls and content from fixed outputs, and
the stream parser giving exactly the whole parser's result for every split of each output
into two and three pieces (and one character at a time)."""

from __future__ import annotations

import json

import pytest

from server.tool_calls import (
    CallDelta,
    ContentDelta,
    HermesStreamParser,
    finish_reason_of,
    parse_tool_calls,
)

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>'

# (output, content, [(name, arguments)])
SAMPLES = [
    ("Hello, no tools here.", "Hello, no tools here.", []),
    ("  spaced  <b>html</b> a<tool x ", "  spaced  <b>html</b> a<tool x ", []),
    (CALL_A, None, [("get_weather", {"city": "Paris"})]),
    (
        f"Let me check.\n{CALL_A}\n{CALL_B}\n",
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, 3]})],
    ),
    (f"{CALL_A} Done.", "Done.", [("get_weather", {"city": "Paris"})]),
    # Invalid JSON, a missing name, non-object arguments: the tag stays as content.
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (
        'x <tool_call>{"arguments": {}}</tool_call>',
        'x <tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        [],
    ),
    # No arguments means {}; a tag that never closes is parsed to the end of the output.
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
    (
        f'{CALL_B}\n<tool_call>\n{{"name": "now"}}\n',
        None,
        [("add", {"a": 1, "b": [2, 3]}), ("now", {})],
    ),
    ('text <tool_call>\n{"name": "cut', 'text <tool_call>\n{"name": "cut', []),
    # A valid call beside an invalid one; unicode arguments are kept as they are.
    (
        f"{CALL_A}\n<tool_call>oops</tool_call>",
        "<tool_call>oops</tool_call>",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<tool_call>{"name": "say", "arguments": {"t": "héllo ☃"}}</tool_call>',
        None,
        [("say", {"t": "héllo ☃"})],
    ),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("output", "content", "calls"), SAMPLES)
def test_the_parser_splits_calls_from_content(output, content, calls):
    parsed = parse_tool_calls(output)
    assert parsed.content == content
    assert _calls(parsed.tool_calls) == calls
    assert all(call.id.startswith("call_") for call in parsed.tool_calls)
    assert len({call.id for call in parsed.tool_calls}) == len(calls)


def test_unicode_arguments_are_json_text_without_escapes():
    [call] = parse_tool_calls(SAMPLES[-1][0]).tool_calls
    assert call.arguments == '{"t": "héllo ☃"}'


def test_max_calls_keeps_the_first_and_drops_the_rest_from_content_too():
    parsed = parse_tool_calls(f"{CALL_A}\n{CALL_B}", max_calls=1)
    assert parsed.content is None and _calls(parsed.tool_calls) == [
        ("get_weather", {"city": "Paris"})
    ]


def _stream(pieces: list[str], max_calls: int | None = None) -> tuple[str | None, list, list]:
    parser = HermesStreamParser(max_calls)
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls = [d for d in deltas if isinstance(d, CallDelta)]
    return content, calls, deltas


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i in range(1, len(text)):
        for j in range(i + 1, len(text)):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("max_calls", [None, 1])
@pytest.mark.parametrize("output", [sample[0] for sample in SAMPLES])
def test_every_split_of_a_stream_gives_the_parsers_result(output, max_calls):
    whole = parse_tool_calls(output, max_calls)
    for pieces in _splits(output):
        streamed_content, call_deltas, deltas = _stream(pieces, max_calls)
        assert streamed_content == (whole.content or ""), pieces
        assert _calls(d.call for d in call_deltas) == _calls(whole.tool_calls), pieces
        assert [d.index for d in call_deltas] == list(range(len(whole.tool_calls)))
        assert all(d.text for d in deltas if isinstance(d, ContentDelta))


def test_text_that_cannot_start_a_call_streams_without_delay():
    parser = HermesStreamParser()
    assert parser.feed("Hello") == [ContentDelta("Hello")]
    assert parser.feed(" world <") == [ContentDelta(" world")]  # " <" may start a call
    assert parser.feed("b>") == [ContentDelta(" <b>")]
    assert parser.feed("<tool_call>{") == []
    assert parser.finish() == [ContentDelta("<tool_call>{")]


def test_a_streamed_call_is_emitted_when_its_tag_closes():
    parser = HermesStreamParser(max_calls=1)
    assert parser.feed(CALL_A[:-3]) == []
    [delta] = parser.feed(CALL_A[-3:])
    assert isinstance(delta, CallDelta) and delta.index == 0 and delta.call.name == "get_weather"
    assert parser.feed("\n" + CALL_B) == []  # past max_calls: dropped
    assert parser.finish() == [] and parser.num_calls == 2


@pytest.mark.parametrize(
    ("reason", "called", "expected"),
    [("stop", True, "tool_calls"), ("stop", False, "stop"), ("length", True, "length")],
)
def test_finish_reason_is_tool_calls_only_for_a_natural_end(reason, called, expected):
    assert finish_reason_of(reason, called) == expected
