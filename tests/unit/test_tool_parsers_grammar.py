"""Each tool-call format's grammar for required and named tool_choice (compiled by xgrammar
with the embedded model's tokenizer): it takes the calls that format's parser reads, the
turn may end after any complete call, and nothing else (text around the calls, another
function under a named choice, a second call without parallel_tool_calls)."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from engine.loader import hf_checkpoint_dir
from server.tool_calls import FunctionTool, ToolPolicy, tool_call_constraint, tool_call_format

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

# format -> (a get_weather call, an add call, how two calls join under required)
CALLS = {
    "hermes": (
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            "</tool_call>"
        ),
        '<tool_call>\n{"name": "add", "arguments": {"a": 1.5}}\n</tool_call>',
        "",
    ),
    "qwen3_coder": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        "<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n</function>\n</tool_call>",
        "",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "add", "parameters": {"a": 1.5}}',
        "",
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1.5}}]',
        "",
    ),
    "pythonic": ('get_weather(city="Paris")', "add()", ", "),
}


def _wrap(name: str, calls: list[str], joiner: str) -> str:
    text = joiner.join(calls)
    return f"[{text}]" if name == "pythonic" else text


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(hf_checkpoint_dir("default"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )
    return xgr.GrammarCompiler(info, max_threads=1)


def _accepts(compiler, tokenizer, policy: ToolPolicy, name: str, text: str) -> bool:
    """Whether the policy's grammar in this format takes `text` and then ends (EOS)."""
    fmt = tool_call_format(name, None, TOOLS)
    grammar = xgr.Grammar.from_ebnf(tool_call_constraint(policy, fmt).spec)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


@pytest.mark.parametrize("name", CALLS)
def test_the_forced_grammar_takes_the_calls_its_parser_reads(compiler, tokenizer, name):
    weather, add, joiner = CALLS[name]
    named = ToolPolicy(TOOLS, "named", "get_weather")
    required = ToolPolicy(TOOLS, "required")
    single = ToolPolicy(TOOLS, "required", parallel=False)
    accepted = [
        (named, [weather]),
        (required, [add]),
        (required, [weather, add, add]),
        (single, [add]),
    ]
    fmt = tool_call_format(name, None, TOOLS)
    for policy, calls in accepted:
        text = _wrap(name, calls, joiner)
        assert _accepts(compiler, tokenizer, policy, name, text), (policy, text)
        parsed = fmt.parse(text, policy.max_calls)  # all of it is calls
        assert parsed.content is None
        assert len(parsed.tool_calls) == min(len(calls), policy.max_calls or len(calls))
    refused = [
        (named, _wrap(name, [add], joiner)),
        (named, _wrap(name, [weather, weather], joiner)),
        (single, _wrap(name, [add, add], joiner)),
        (required, "Sure. " + _wrap(name, [add], joiner)),
        (required, ""),
    ]
    if joiner == "":  # the newline a model likes after a call does not start another one
        refused.append((required, _wrap(name, [add, add], "\n")))
    for policy, text in refused:
        assert not _accepts(compiler, tokenizer, policy, name, text), (policy, text)
