"""openai-agents' cases, each run on the chat completions model and on the Responses model."""

from __future__ import annotations

from typing import Any

from loadtest.framework_cases.common import (
    MAX_TOKENS,
    PERSON,
    TIME,
    WEATHER,
    CaseContext,
    Person,
    check_call,
    expect,
)

# --- openai-agents: chat completions and Responses models ---------------------------------------


async def _run_agent(
    ctx: CaseContext,
    api: str,
    prompt: str,
    *,
    choice: str | None = None,
    behavior: str = "run_llm_again",
    output_type: type | None = None,
    with_tools: bool = True,
    stream: bool = False,
) -> tuple[Any, list[str]]:
    """Runs an agent (at most 3 turns) on `api` ("chat" or "responses"); returns the result and
    the tools it invoked, with their arguments as the tool received them."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    invoked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        invoked.append(check_call("get_weather", {"city": city}))
        return f"Sunny, 21 C in {city}"

    @function_tool
    def get_time(timezone: str) -> str:
        """Get the current time in a time zone."""
        invoked.append(check_call("get_time", {"timezone": timezone}))
        return "It is 09:30"

    model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        name="assistant",
        instructions="You are a helpful assistant.",
        model=model_class(model=ctx.model, openai_client=ctx.async_openai()),
        tools=[get_weather, get_time] if with_tools else [],
        tool_use_behavior=behavior,  # type: ignore[arg-type]
        output_type=output_type,
        model_settings=ModelSettings(tool_choice=choice, temperature=0, max_tokens=MAX_TOKENS),
    )
    if not stream:
        return await Runner.run(agent, prompt, max_turns=3), invoked
    result = Runner.run_streamed(agent, prompt, max_turns=3)
    async for _ in result.stream_events():
        pass
    return result, invoked


def _final_text(result: Any, invoked: list[str]) -> str:
    output = result.final_output
    expect(isinstance(output, str) and output, f"final_output {output!r}")
    return f"tools {invoked} -> {output[:60]!r}"


def _stopped_at(result: Any, invoked: list[str], tool_output: str) -> str:
    expect(invoked, "no tool invoked")
    expect(str(result.final_output).startswith(tool_output), f"final {result.final_output!r}")
    return f"{invoked}"


async def run_agents_plain(ctx: CaseContext, api: str, stream: bool = False) -> str:
    return _final_text(*await _run_agent(ctx, api, "Say hello.", with_tools=False, stream=stream))


async def run_agents_required_stop(ctx: CaseContext, api: str, stream: bool = False) -> str:
    run = _run_agent(ctx, api, WEATHER, choice="required", behavior="stop_on_first_tool",
                     stream=stream)  # fmt: skip
    return _stopped_at(*await run, "Sunny")


async def run_agents_named_stop(ctx: CaseContext, api: str) -> str:
    run = _run_agent(ctx, api, TIME, choice="get_time", behavior="stop_on_first_tool")
    return _stopped_at(*await run, "It is")


async def run_agents_required_loop(ctx: CaseContext, api: str, stream: bool = False) -> str:
    result, invoked = await _run_agent(ctx, api, WEATHER, choice="required", stream=stream)
    expect(invoked, "no tool invoked")
    return _final_text(result, invoked)


async def run_agents_output_type(ctx: CaseContext, api: str) -> str:
    result, _ = await _run_agent(ctx, api, PERSON, output_type=Person, with_tools=False)
    expect(isinstance(result.final_output, Person), f"final_output {result.final_output!r}")
    return repr(result.final_output)


async def run_agents_output_type_tools(ctx: CaseContext, api: str) -> str:
    """A forced tool call, then (tool_choice reset) the final output as a Person."""
    prompt = f"First call get_weather for Lyon. Then: {PERSON}"
    result, invoked = await _run_agent(ctx, api, prompt, choice="required", output_type=Person)
    expect(invoked, "no tool invoked")
    expect(isinstance(result.final_output, Person), f"final_output {result.final_output!r}")
    return f"{invoked} -> {result.final_output!r}"
