"""The cases that loadtest/frameworks.py runs: agent and app frameworks (the openai SDK,
openai-agents, langchain-openai, instructor) against one OpenAI-compatible server.

A case is a function of a `CaseContext`; it returns a one-line detail when it passes and raises
when it fails (`CaseFailed` for a result of the wrong shape, or whatever the framework raised).
Only the protocol is judged, never whether a 135M model's answer is right: a forced tool call
must name the forced (or a declared) tool with arguments that parse and validate against the
tool's schema, a structured output must validate against its pydantic model, a stream must end
in a result of the same shape. Decoding is greedy with at most MAX_TOKENS tokens per request.

The framework packages are not dependencies of meterserve: each case imports what it uses, so
a missing package fails only its own cases (run them from a separate venv, see frameworks.py).
The name's prefix is the framework: sdk_ (openai), agents_, lc_ (langchain-openai), instr_.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from loadtest.framework_cases.agents import (
    run_agents_named_stop,
    run_agents_output_type,
    run_agents_output_type_tools,
    run_agents_plain,
    run_agents_required_loop,
    run_agents_required_stop,
)
from loadtest.framework_cases.common import CaseContext, CaseFailed
from loadtest.framework_cases.instructor import (
    instr_json,
    instr_json_schema,
    instr_partial_tools,
    instr_responses_tools,
    instr_tools,
    instr_tools_nested,
    instr_tools_strict,
)
from loadtest.framework_cases.langchain import (
    lc_bind_tools_auto,
    lc_bind_tools_named,
    lc_bind_tools_required,
    lc_bind_tools_stream,
    lc_invoke,
    lc_responses_bind_tools_required,
    lc_responses_structured_json_schema,
    lc_structured_function_calling,
    lc_structured_json_mode,
    lc_structured_json_schema,
    lc_tool_loop,
)
from loadtest.framework_cases.openai_sdk import (
    sdk_chat_json_object,
    sdk_chat_json_schema_strict,
    sdk_chat_parse,
    sdk_chat_parse_nested,
    sdk_chat_parse_tools,
    sdk_chat_parse_tools_nested,
    sdk_chat_plain,
    sdk_chat_stream_parse,
    sdk_chat_stream_plain,
    sdk_chat_stream_tools_named,
    sdk_chat_stream_tools_required,
    sdk_chat_tool_loop,
    sdk_chat_tools_auto,
    sdk_chat_tools_named,
    sdk_chat_tools_none,
    sdk_chat_tools_required,
    sdk_chat_tools_required_single,
    sdk_responses_json_schema,
    sdk_responses_parse,
    sdk_responses_parse_nested,
    sdk_responses_plain,
    sdk_responses_stream_parse,
    sdk_responses_stream_text,
    sdk_responses_stream_tool,
    sdk_responses_tool_loop,
    sdk_responses_tools_named,
    sdk_responses_tools_required,
)

_PLAIN_CASES: tuple[Callable[[CaseContext], Any], ...] = (
    sdk_chat_plain, sdk_chat_tools_auto, sdk_chat_tools_required, sdk_chat_tools_named,
    sdk_chat_tools_required_single, sdk_chat_tools_none, sdk_chat_stream_plain,
    sdk_chat_stream_tools_required, sdk_chat_stream_tools_named, sdk_chat_json_schema_strict,
    sdk_chat_json_object, sdk_chat_parse, sdk_chat_parse_tools, sdk_chat_parse_nested,
    sdk_chat_parse_tools_nested, sdk_chat_stream_parse, sdk_chat_tool_loop,
    sdk_responses_plain, sdk_responses_tools_required, sdk_responses_tools_named,
    sdk_responses_json_schema, sdk_responses_parse, sdk_responses_parse_nested,
    sdk_responses_stream_text, sdk_responses_stream_tool, sdk_responses_stream_parse,
    sdk_responses_tool_loop,
    lc_invoke, lc_bind_tools_required, lc_bind_tools_named, lc_bind_tools_auto,
    lc_bind_tools_stream, lc_tool_loop, lc_structured_json_schema,
    lc_structured_function_calling, lc_structured_json_mode, lc_responses_bind_tools_required,
    lc_responses_structured_json_schema,
    instr_json_schema, instr_tools, instr_tools_strict, instr_tools_nested, instr_json,
    instr_responses_tools, instr_partial_tools,
)  # fmt: skip
_AGENT_CASES = (
    ("plain", run_agents_plain, {}),
    ("required_stop", run_agents_required_stop, {}),
    ("named_stop", run_agents_named_stop, {}),
    ("required_loop", run_agents_required_loop, {}),
    ("output_type", run_agents_output_type, {}),
    ("output_type_tools", run_agents_output_type_tools, {}),
    ("streamed_required_stop", run_agents_required_stop, {"stream": True}),
)
# Every case by name, in the order they run; an agents_ case runs on the chat completions model
# (agents_chat_*) and on the Responses model (agents_responses_*).
__all__ = ["CASES", "CaseContext", "CaseFailed"]

CASES: dict[str, Callable[[CaseContext], Any]] = {
    **{fn.__name__: fn for fn in _PLAIN_CASES},
    **{
        f"agents_{api}_{name}": partial(fn, api=api, **kwargs)
        for api in ("chat", "responses")
        for name, fn, kwargs in _AGENT_CASES
    },
}
