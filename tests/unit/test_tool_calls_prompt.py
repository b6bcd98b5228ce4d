"""Tools into the prompt: SmolLM2's template (no tools) gets meterserve's hermes section and
the tool-call history as hermes text; a template that takes tools gets them, with a call's
arguments as an object. Rendered with the real SmolLM2 tokenizer and transformers' templates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from engine.loader import hf_checkpoint_dir
from server.openai.prompts import apply_chat_template
from server.openai.protocol import ChatMessage
from server.tool_calls import FunctionTool, conversation_for_template, template_renders_tools
from server.tool_calls.prompt import tools_section

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = FunctionTool("now")  # no parameters

# A tool-aware template in the style of Qwen2.5's: tools as JSON, calls with `tojson`.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}\n{% endfor %}"
)

HISTORY = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "tool", "content": "12:00", "tool_call_id": "c2"},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(hf_checkpoint_dir("default"))


def test_smollm2s_template_has_no_tools_and_a_tool_template_does(tokenizer):
    assert not template_renders_tools(tokenizer.chat_template)
    assert template_renders_tools(TOOLS_TEMPLATE)
    assert not template_renders_tools(None)


def test_the_hermes_section_shows_each_signature_and_the_call_format():
    section = tools_section([WEATHER, CLOCK])
    inside = section.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in inside] == [WEATHER.as_openai(), CLOCK.as_openai()]
    assert CLOCK.as_openai() == {"type": "function", "function": {"name": "now"}}
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in section
    )


async def test_smollm2_gets_the_tools_as_its_system_prompt(tokenizer):
    client = SimpleNamespace(tokenizer=tokenizer)
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    prompt = await apply_chat_template(client, messages, tools=[WEATHER])
    text = tokenizer.decode(prompt)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": tools_section([WEATHER])},
         {"role": "user", "content": "Weather in Paris?"}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert text == expected
    assert "SmolLM" not in text  # the template's default system prompt gave way to the tools


async def test_a_system_message_keeps_its_text_before_the_tools(tokenizer):
    client = SimpleNamespace(tokenizer=tokenizer)
    messages = [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris?"),
    ]
    text = tokenizer.decode(await apply_chat_template(client, messages, tools=[WEATHER]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert text.count("<|im_start|>system") == 1


async def test_the_tool_call_history_reaches_smollm2s_prompt_as_hermes_text(tokenizer):
    client = SimpleNamespace(tokenizer=tokenizer)
    messages = [ChatMessage.model_validate(m) for m in HISTORY]
    text = tokenizer.decode(await apply_chat_template(client, messages, tools=[WEATHER, CLOCK]))
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text


def test_history_text_keeps_the_assistants_words_before_its_calls():
    turns, tools_arg = conversation_for_template(
        [{"role": "assistant", "content": "Checking.", "tool_calls": HISTORY[1]["tool_calls"][1:]}],
        [],
        None,
    )
    assert tools_arg is None
    assert turns == [
        {
            "role": "assistant",
            "content": 'Checking.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        }
    ]


def test_a_tool_template_gets_tools_and_calls_with_object_arguments(tokenizer):
    turns, tools_arg = conversation_for_template(HISTORY, [WEATHER, CLOCK], TOOLS_TEMPLATE)
    assert tools_arg == [WEATHER.as_openai(), CLOCK.as_openai()]
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # a copy
    assert turns[2] == HISTORY[2]
    text = tokenizer.apply_chat_template(
        turns, tools=tools_arg, chat_template=TOOLS_TEMPLATE, tokenize=False
    )
    assert 'CALL get_weather {"city": "Paris"}' in text  # quoted once, not twice
    assert "[tool]sunny (for c1)" in text and text.startswith('TOOLS:{"type": "function"')
