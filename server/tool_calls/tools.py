"""Function tools and what a request lets the model do with them (tool_choice), as plain data.

Both request shapes (chat's `{"type": "function", "function": {...}}`, the Responses API's flat
`{"type": "function", "name": ...}`) become FunctionTool values at the HTTP edge; everything in
server/tool_calls works on these, so both endpoints share one prompt, constraint and parser.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from server.http.errors import bad_request

ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function the model may call. `parameters` is its arguments' JSON schema (None: the
    function takes no arguments)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The schema the arguments follow; no parameters means an empty object, as OpenAI."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters

    def as_openai(self) -> dict[str, Any]:
        """The chat-completions shape, which chat templates take as `tools` (and which the
        hermes prompt shows the model)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """A request's tools and tool_choice, resolved and checked.

    mode: none (tools shown, output is text: vLLM's default), auto (free output, calls parsed
    from it), required (one or more calls, enforced by a grammar), named (exactly one call to
    `name`, enforced). parallel False keeps one call at most."""

    tools: tuple[FunctionTool, ...] = ()
    mode: ToolChoiceMode = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    @property
    def max_calls(self) -> int | None:
        """Calls kept from the output (None: all)."""
        return None if self.parallel and self.mode != "named" else 1

    @property
    def forced_tools(self) -> tuple[FunctionTool, ...]:
        """The tools a grammar allows: the named one, all under required, none otherwise."""
        if self.mode == "named":
            return tuple(t for t in self.tools if t.name == self.name)
        if self.mode == "required":
            return self.tools
        return ()


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """tool_choice as given: a mode, and the function's name for a named choice."""

    mode: ToolChoiceMode
    name: str | None = None


def resolve_tool_policy(
    tools: Sequence[FunctionTool],
    choice: ToolChoice | None,
    parallel: bool | None,
    *,
    tools_param: str = "tools",
    choice_param: str = "tool_choice",
) -> ToolPolicy:
    """Check tools against tool_choice (400s naming the field) and resolve the defaults:
    tool_choice is auto with tools and none without, as OpenAI's."""
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise bad_request(
            f"{tools_param} has more than one function named {', '.join(duplicates)}",
            param=tools_param,
        )
    for tool in tools:
        kind = (tool.parameters or {}).get("type", "object")
        if kind != "object":  # arguments are an object, in the call format as in OpenAI's
            raise bad_request(
                f"{tools_param}: the parameters of {tool.name} must be a JSON schema of type "
                f"object, got type {json.dumps(kind)}",
                param=tools_param,
            )
    if choice is None:
        choice = ToolChoice("auto" if tools else "none")
    if choice.mode != "none" and not tools:
        raise bad_request(
            f"{choice_param} {_describe(choice)} is only allowed when {tools_param} are given",
            param=choice_param,
        )
    if choice.mode == "named" and choice.name not in names:
        raise bad_request(
            f"{choice_param} names the function {choice.name!r}, which is not in "
            f"{tools_param} ({', '.join(names)})",
            param=choice_param,
        )
    return ToolPolicy(
        tools=tuple(tools),
        mode=choice.mode,
        name=choice.name,
        parallel=True if parallel is None else parallel,
    )


def _describe(choice: ToolChoice) -> str:
    return f"function {choice.name!r}" if choice.mode == "named" else repr(choice.mode)


def check_function_tool(index: int, tool_type: str, defined: bool, needs: str) -> None:
    """400 (param `tools`) unless tools[index] is a function tool whose definition (`needs`:
    the field that holds it in this API's shape) is there: chat's and Responses' rule."""
    if tool_type != "function":
        raise bad_request(
            f"tools[{index}] has type {tool_type!r}; only function tools are supported",
            param="tools",
            code="unsupported_parameter",
        )
    if not defined:
        raise bad_request(f"tools[{index}] needs `{needs}`", param="tools")
