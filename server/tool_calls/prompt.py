"""Tools and tool-call history into the chat template's input.

Two paths, chosen by the template itself:
- native: the template takes `tools` (Qwen2/2.5/3, Hermes, Llama 3.1, Mistral...): tools go to
  apply_chat_template(tools=...), messages keep `tool_calls` and `tool_call_id`, and a call's
  `arguments` string is parsed into an object first, as vLLM does (templates print it with
  `tojson`, which would quote a string twice);
- hermes: the template never mentions tools (SmolLM2's): meterserve renders them in the
  hermes format the parser reads. A `# Tools` section with each function's signature inside
  `<tools></tools>` and the instruction to answer with `<tool_call>` JSON is appended to the
  first system message (or is the system message); an assistant's calls become
  `<tool_call>` text after its content; `tool` messages become `<tool_response>` blocks in a
  user turn (consecutive results share one), as Qwen2.5's template renders them.

Messages are the template's plain dicts: {"role", "content", optional "tool_calls" in
OpenAI's shape, optional "tool_call_id"}.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from server.tool_calls.tools import FunctionTool
from server.tool_parsers.hermes import TOOL_CALL_END, TOOL_CALL_START

_TOOLS_WORD = re.compile(r"\btools\b")


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template takes `tools` (and then, as every tool-aware template does, the
    assistant's tool_calls and tool messages)."""
    return bool(chat_template) and _TOOLS_WORD.search(chat_template) is not None


def conversation_for_template(
    conversation: Sequence[dict[str, Any]],
    tools: Sequence[FunctionTool],
    chat_template: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools argument of apply_chat_template) for this template's path."""
    if template_renders_tools(chat_template):
        tools_arg = [tool.as_openai() for tool in tools] or None
        return [_with_object_arguments(turn) for turn in conversation], tools_arg
    turns = history_as_text(conversation)
    if tools:
        turns = with_tools_section(turns, tools)
    return turns, None


def tools_section(tools: Sequence[FunctionTool]) -> str:
    """The hermes system-prompt section that shows the model its tools and the call format."""
    signatures = "\n".join(json.dumps(tool.as_openai(), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        f"{TOOL_CALL_END}"
    )


def with_tools_section(
    turns: list[dict[str, Any]], tools: Sequence[FunctionTool]
) -> list[dict[str, Any]]:
    section = tools_section(tools)
    if turns and turns[0]["role"] == "system":
        first = dict(turns[0])
        first["content"] = f"{first['content']}\n\n{section}" if first["content"] else section
        return [first, *turns[1:]]
    return [{"role": "system", "content": section}, *turns]


def call_text(name: str, arguments: Any) -> str:
    """One call as the hermes format writes it (the constrained grammar's exact shape)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def history_as_text(conversation: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls and tool results as hermes text, for a template that knows neither."""
    turns: list[dict[str, Any]] = []
    previous_role = None
    for turn in conversation:
        role, content = turn["role"], turn["content"]
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous_role == "tool":  # consecutive results share one user turn
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block})
        elif role == "assistant" and turn.get("tool_calls"):
            texts = [call_text(c["function"]["name"], _arguments(c)) for c in turn["tool_calls"]]
            turns.append(
                {"role": role, "content": "\n".join([content, *texts] if content else texts)}
            )
        else:
            turns.append({"role": role, "content": content})
        previous_role = role
    return turns


def _with_object_arguments(turn: dict[str, Any]) -> dict[str, Any]:
    calls = turn.get("tool_calls")
    if not calls:
        return dict(turn)
    parsed = [
        {**call, "function": {**call["function"], "arguments": _arguments(call)}} for call in calls
    ]
    return {**turn, "tool_calls": parsed}


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object when its string is JSON; otherwise as given."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
