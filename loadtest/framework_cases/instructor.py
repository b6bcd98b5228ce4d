"""instructor's cases: JSON_SCHEMA, TOOLS, TOOLS_STRICT, JSON, RESPONSES_TOOLS, partials."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from loadtest.framework_cases.common import (
    MAX_TOKENS,
    MEETING,
    PERSON,
    SAMPLING,
    CaseContext,
    Meeting,
    Person,
    expect,
    user,
)

# --- instructor -------------------------------------------------------------------------------


def _instructor(ctx: CaseContext, mode_name: str) -> Any:
    import instructor

    return instructor.from_openai(ctx.openai(), mode=getattr(instructor.Mode, mode_name))


def _instructor_person(
    ctx: CaseContext, mode_name: str, model: type[BaseModel] = Person, prompt: str = PERSON
) -> str:
    result = _instructor(ctx, mode_name).create(
        model=ctx.model, messages=user(prompt), response_model=model, max_retries=0, **SAMPLING
    )
    expect(isinstance(result, model), f"result {result!r}")
    return repr(result)[:120]


def instr_json_schema(ctx: CaseContext) -> str:
    return _instructor_person(ctx, "JSON_SCHEMA")


def instr_tools(ctx: CaseContext) -> str:
    return _instructor_person(ctx, "TOOLS")


def instr_tools_strict(ctx: CaseContext) -> str:
    return _instructor_person(ctx, "TOOLS_STRICT")


def instr_tools_nested(ctx: CaseContext) -> str:
    return _instructor_person(ctx, "TOOLS", Meeting, MEETING)


def instr_json(ctx: CaseContext) -> str:
    return _instructor_person(ctx, "JSON")


def instr_responses_tools(ctx: CaseContext) -> str:
    person = _instructor(ctx, "RESPONSES_TOOLS").create(
        model=ctx.model, messages=user(PERSON), response_model=Person, max_retries=0,
        temperature=0, max_output_tokens=MAX_TOKENS,
    )  # fmt: skip
    expect(isinstance(person, Person), f"result {person!r}")
    return repr(person)


def instr_partial_tools(ctx: CaseContext) -> str:
    partials = list(
        _instructor(ctx, "TOOLS").create_partial(
            model=ctx.model, messages=user(PERSON), response_model=Person, max_retries=0,
            **SAMPLING,
        )
    )  # fmt: skip
    expect(partials, "no partial objects streamed")
    final = Person.model_validate(partials[-1].model_dump())
    return f"{len(partials)} partials -> {final!r}"
