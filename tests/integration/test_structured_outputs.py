"""Structured outputs over real HTTP with the official `openai` client and the real model:
every constrained output parses and validates against its schema (the `jsonschema` package),
greedy and sampled, streamed or not, on both endpoints; a schema that does not compile is a
400 naming the problem. Requests run concurrently, so they share batches with each other."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError
from server_process import ServerProcess

MAX_TOKENS = 96

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
            }
        },
        "required": ["person"],
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "string", "enum": ["low", "high"]},
        },
        "required": ["sentiment", "confidence"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["count", "ratio"],
    },
    "booleans": {
        "type": "object",
        "properties": {"is_capital": {"type": "boolean"}, "is_coastal": {"type": "boolean"}},
        "required": ["is_capital", "is_coastal"],
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 100},
        "minItems": 1,
        "maxItems": 4,
    },
}


def _messages(name: str) -> list[dict]:
    return [
        {"role": "system", "content": "Answer with JSON only."},
        {"role": "user", "content": f"Give an example for '{name}' about Paris."},
    ]


def _format(name: str) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


async def _chat(client: AsyncOpenAI, name: str, **sampling):
    response = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=_messages(name),
        response_format=_format(name),
        max_tokens=MAX_TOKENS,
        **sampling,
    )
    return name, response.choices[0]


async def test_every_schema_validates_greedy_and_sampled(openai_client: AsyncOpenAI):
    calls = [_chat(openai_client, name, temperature=0.0) for name in SCHEMAS]
    calls += [
        _chat(openai_client, name, temperature=1.0, seed=seed)
        for name in SCHEMAS
        for seed in (1, 2)
    ]
    for name, choice in await asyncio.gather(*calls):
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


async def test_a_seeded_constrained_request_is_reproducible(openai_client: AsyncOpenAI):
    # One after the other, the prompt cached by the first: both are computed identically.
    await _chat(openai_client, "booleans", temperature=0.0)
    first = await _chat(openai_client, "booleans", temperature=1.0, seed=7)
    second = await _chat(openai_client, "booleans", temperature=1.0, seed=7)
    assert first[1].message.content == second[1].message.content


async def test_json_object_gives_an_object_and_streams_to_valid_json(openai_client: AsyncOpenAI):
    plain = await openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=_messages("a city"),
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    stream = await openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=_messages("booleans"),
        response_format=_format("booleans"),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    pieces, finishes = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    # json_object: any JSON object; only whitespace-free JSON until EOS is possible.
    if plain.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(plain.choices[0].message.content), dict)
    else:  # an object can nest without end; what came is still a JSON object's prefix
        assert plain.choices[0].message.content.startswith("{")
    assert finishes == ["stop"]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS["booleans"])


async def test_completions_take_response_format_and_structured_outputs(
    openai_client: AsyncOpenAI,
):
    prompt = "A JSON list of small numbers: "
    response_format = _format("top_level_array")
    plain, streamed, choice, regex, grammar = await asyncio.gather(
        openai_client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"response_format": response_format},
        ),
        openai_client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=3,
            stream=True,
            extra_body={"structured_outputs": {"json": SCHEMAS["enums"]}},
        ),
        openai_client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Is Paris in France? Answer: ",
            max_tokens=8,
            temperature=0.0,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        ),
        openai_client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="A date: ",
            max_tokens=16,
            temperature=0.0,
            extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
        ),
        openai_client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Say hello: ",
            max_tokens=16,
            temperature=0.0,
            extra_body={"structured_outputs": {"grammar": 'root ::= "hello" (" " "world")?'}},
        ),
    )
    assert plain.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(plain.choices[0].text), SCHEMAS["top_level_array"])
    pieces = [c.choices[0].text async for c in streamed if c.choices]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS["enums"])
    assert choice.choices[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", regex.choices[0].text)
    assert grammar.choices[0].text in ("hello", "hello world")
    for response in (choice, regex, grammar):
        assert response.choices[0].finish_reason == "stop"


async def test_vllms_guided_fields_constrain_the_output(openai_client: AsyncOpenAI):
    """guided_json / guided_regex / guided_choice / guided_grammar, vLLM's older spelling of
    structured_outputs, each constrain the output (they used to be ignored: a 200 with
    unconstrained text); a backend other than xgrammar is a 400 naming the field."""

    def completion(prompt: str, max_tokens: int, **guided):
        return openai_client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body=guided,
        )

    schema, choice, regex, grammar = await asyncio.gather(
        openai_client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=_messages("booleans"),
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"guided_json": SCHEMAS["booleans"], "guided_decoding_backend": "xgrammar"},
        ),
        completion("Is Paris in France? Answer: ", 8, guided_choice=["yes", "no", "maybe"]),
        completion("A date: ", 16, guided_regex=r"\d{4}-\d{2}-\d{2}"),
        completion("Say hello: ", 16, guided_grammar='root ::= "hello" (" " "world")?'),
    )
    assert schema.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(schema.choices[0].message.content), SCHEMAS["booleans"])
    assert choice.choices[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", regex.choices[0].text)
    assert grammar.choices[0].text in ("hello", "hello world")
    for response in (choice, regex, grammar):
        assert response.choices[0].finish_reason == "stop"
    with pytest.raises(BadRequestError) as raised:
        await completion("x", 4, guided_regex="a+", guided_decoding_backend="outlines")
    assert raised.value.body["param"] == "guided_decoding_backend"


@pytest.mark.parametrize(
    ("body", "param", "problem"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": 3}}}},
            "response_format",
            "properties must be an object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "none"}}},
            "response_format",
            "json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "((("}}, "structured_outputs", "parenthesis"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens", "combined"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "not both",
        ),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "not several"),
    ],
)  # fmt: skip
async def test_a_constraint_that_cannot_run_is_a_400(
    openai_client: AsyncOpenAI, body, param, problem
):
    with pytest.raises(BadRequestError) as raised:
        await openai_client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=_messages("x"),
            max_tokens=8,
            extra_body=body,
        )
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param
    assert problem in error["message"]


def _heavy_schema(num_properties: int = 400) -> dict:
    """Like the schema that once stalled every other tenant's decode: each property has a
    pattern of its own (so no sub-rule is shared), compiled on this machine in ~3 s."""
    tag = uuid.uuid4().hex[:6]  # a cold grammar cache, whatever ran before
    properties = {
        f"f{i}_{tag}": {"type": "string", "pattern": f"^[a-z]{{2,8}}-{i}[0-9]{{0,3}}$"}
        for i in range(num_properties)
    }
    return {"type": "object", "properties": properties}


def _compiled_in_step(server: ServerProcess, request_id: str) -> bool:
    """Whether the engine logged compiling this request's grammar inside a step."""
    log = server.log_path.read_text(errors="replace")
    return f"request {request_id}-0: grammar compiled inside the step" in log


async def test_a_heavy_schema_compiles_off_the_engine_while_another_request_streams(
    openai_client: AsyncOpenAI, main_server: ServerProcess
):
    """Structural, not timed: the heavy grammar compiles before its request is submitted
    (its compile seconds are on its bill, beyond its engine seconds), so the engine finds it
    cached and compiles nothing inside a step; the streaming neighbour is billed engine time
    only and runs to its end."""
    stream = await openai_client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Once upon a time",
        max_tokens=64,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = aiter(stream)
    first = await anext(chunks)  # streaming before the heavy request arrives
    schema = _heavy_schema()
    heavy = asyncio.create_task(
        openai_client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=_messages("a record"),
            response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": schema}},
            max_tokens=48,
            temperature=0.0,
        )
    )
    rest = [chunk async for chunk in chunks]
    text = "".join(c.choices[0].text for c in [first, *rest] if c.choices)
    usage = rest[-1].usage.model_extra
    assert rest[-1].usage.completion_tokens == 64 and text
    assert usage["cost_usd"] == pytest.approx(
        usage["prefill_cost_usd"] + usage["decode_cost_usd"], rel=1e-9
    )
    assert usage["grammar_compile_seconds"] == 0.0
    try:
        response = await heavy
    except BadRequestError as exc:  # a machine too slow to compile it within the timeout
        assert exc.status_code == 400 and exc.body["param"] == "response_format"
        return
    choice, extra = response.choices[0], response.usage.model_extra
    engine_cost = extra["prefill_cost_usd"] + extra["decode_cost_usd"]
    assert extra["grammar_compile_seconds"] > 0  # a cold grammar: compiled for this request
    price = extra["prefill_cost_usd"] / extra["prefill_seconds"]
    assert extra["cost_usd"] == pytest.approx(
        engine_cost + extra["grammar_compile_seconds"] * price, rel=1e-6
    )
    assert not _compiled_in_step(main_server, response.id)
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)
    else:  # max_tokens ran out inside the object: still a prefix of one
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


async def test_an_over_size_schema_is_a_400_naming_response_format(
    openai_client: AsyncOpenAI,
):
    huge = {"type": "object", "description": "x" * 70_000}
    with pytest.raises(BadRequestError) as raised:
        await openai_client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=_messages("x"),
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": huge}},
        )
    assert raised.value.body["param"] == "response_format"
    assert "at most 65536" in raised.value.body["message"]
