"""A request's structured-output fields as its one constraint: OpenAI's response_format,
vLLM's structured_outputs, or vLLM's older guided_* fields (server/openai/guided_decoding.py), at
most one of them, compiled ahead before anything is submitted.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler.sampling_params import StructuredOutput
from server.http.errors import bad_request
from server.openai.grammar_compile import check_spec_size, compile_ahead
from server.openai.guided_decoding import guided_constraint
from server.openai.protocol import SamplingFields


async def structured_output_of(body: SamplingFields, client: Any) -> StructuredOutput | None:
    """The request's constraint (response_format, vLLM's structured_outputs or its older
    guided_* fields, server/openai/guided_decoding.py), compiled ahead on the engine's compile
    worker (`client.structured`, server/openai/grammar_compile.py): a grammar xgrammar refuses,
    one over MAX_GRAMMAR_SPEC_CHARS or one that does not compile in time is a 400 naming the
    problem, before anything runs."""
    fmt, vllm = body.response_format, body.structured_outputs
    param = "response_format"
    constraint = None
    if fmt is not None and fmt.type == "json_object":
        constraint = StructuredOutput("json_object")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema", param=param
            )
        constraint = StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))
    if vllm is not None:
        if constraint is not None:
            raise bad_request("give response_format or structured_outputs, not both", param=param)
        param = "structured_outputs"
        constraint = _vllm_constraint(vllm)
    guided = guided_constraint(body)  # vLLM's older guided_* fields
    if guided is not None:
        if constraint is not None:
            raise bad_request(f"give {param} or {guided.param}, not both", param=guided.param)
        param, constraint = guided.param, guided.constraint
    if constraint is not None:
        check_spec_size(len(constraint.spec), param, param)
        await compile_ahead(constraint, client.structured, param, f"invalid {param}")
    return constraint


def _vllm_constraint(params: Any) -> StructuredOutput:
    """Exactly one of vLLM's json, regex, choice, grammar, json_object."""
    given = {
        name: value
        for name, value in (
            ("json", params.json_),
            ("regex", params.regex),
            ("choice", params.choice),
            ("grammar", params.grammar),
            ("json_object", params.json_object or None),
        )
        if value is not None
    }
    if len(given) != 1:
        raise bad_request(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object "
            f"(got {', '.join(sorted(given)) or 'none'})",
            param="structured_outputs",
        )
    [(name, value)] = given.items()
    if name == "json":
        spec = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutput("json_schema", spec)
    if name == "choice":
        return StructuredOutput("choice", json.dumps(value))
    if name == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(name, value)
