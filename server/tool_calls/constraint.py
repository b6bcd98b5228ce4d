"""The grammar that makes `required` and named tool_choice always parse.

The output is forced into the request's tool-call format (server/tool_parsers), each call's
arguments into its function's parameters schema; for hermes, the default:

    named:     <tool_call>\\n{"name": "<name>", "arguments": <schema>}\\n</tool_call>
    required:  one such call to any tool, then more, back to back (only one when
               parallel_tool_calls is false)

then EOS, which the grammar allows after every complete call. Calls follow each other with
no separator (ToolCallFormat.forced_format says why: with a newline between them, the small
model repeated its call until max_tokens).

It is built as an xgrammar structural tag (the format's tag per tool: a constant begin
naming the function, the parameters schema as content, a constant end) and handed to the
engine as the EBNF text of that grammar: the engine's structured-output path
(engine/structured_output.py) takes EBNF as the `grammar` kind, so tool calls need no new
constraint kind there, and are compiled ahead on the engine's compile worker and cached like
any grammar (output_constraint; building the EBNF runs off the event loop too: ~0.1 s for a
400-property schema). JSON inside allows at most one whitespace character in a row: a small
model left free whitespace can spend its whole budget on it.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import xgrammar as xgr

from scheduler.sampling_params import StructuredOutput
from server.http.errors import bad_request
from server.openai.grammar_compile import check_spec_size, compile_ahead
from server.tool_calls.tools import FunctionTool, ToolPolicy
from server.tool_parsers import ToolCallFormat
from server.tool_parsers.hermes import HermesFormat


def tool_call_constraint(
    policy: ToolPolicy, fmt: ToolCallFormat | None = None, tools_param: str = "tools"
) -> StructuredOutput | None:
    """The constraint for the policy's tool_choice in `fmt` (hermes when None; None for
    auto and none), not compiled yet; parameters schemas xgrammar cannot convert, or longer
    than MAX_GRAMMAR_SPEC_CHARS (server/openai/grammar_compile.py) together, are a 400 naming
    `tools_param`."""
    tools = policy.forced_tools
    if not tools:
        return None
    fmt = fmt or HermesFormat(policy.tools)
    num_chars = sum(len(json.dumps(tool.parameters_schema)) for tool in tools)
    check_spec_size(num_chars, tools_param, f"{tools_param}: the parameters schemas to enforce")
    try:
        calls = fmt.forced_format(tools, one_call=policy.max_calls == 1)
        grammar = xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": calls})
    except Exception as exc:  # noqa: BLE001 - whatever a schema breaks in xgrammar is the user's
        raise bad_request(
            f"{_cannot_enforce(tools_param, tools)}: {_first_line(exc)}", param=tools_param
        ) from None
    return StructuredOutput("grammar", str(grammar))


async def output_constraint(
    structured_output: StructuredOutput | None,
    policy: ToolPolicy,
    client: Any,
    fmt: ToolCallFormat | None = None,
) -> StructuredOutput | None:
    """The request's one output constraint: its structured output, or the
    grammar a required or named tool_choice needs so its calls always parse in `fmt`,
    compiled ahead like a structured output (`client.structured`). With both, the forced call
    wins: the format shapes a turn that answers in text, and a forced turn answers with a
    call (OpenAI and vLLM take both; an agent with an output type and a forced tool sends
    them together, then its next turn, tool_choice auto, answers in the format, whose
    grammar the structured-output path has compiled and cached by then)."""
    if not policy.forced_tools:
        return structured_output
    tool_constraint = await asyncio.to_thread(tool_call_constraint, policy, fmt)
    assert tool_constraint is not None  # forced tools always give one
    problem = _cannot_enforce("tools", policy.forced_tools)
    await compile_ahead(tool_constraint, client.structured, "tools", problem)
    return tool_constraint


def _cannot_enforce(tools_param: str, tools: tuple[FunctionTool, ...]) -> str:
    names = ", ".join(tool.name for tool in tools)
    return f"{tools_param}: the parameters schema of {names} cannot be enforced"


def _first_line(exc: Exception) -> str:
    """The message without xgrammar's "[time] file.cc:line: " prefix."""
    lines = str(exc).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(exc).__name__
