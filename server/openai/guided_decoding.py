"""vLLM's older structured-output fields (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, `guided_json_object`), honoured as aliases of `structured_outputs`.

Clients written against vLLM before its `structured_outputs` field still send these; each
maps onto a constraint xgrammar compiles (JSON schema, regex, choice list, EBNF grammar, any
JSON object). What meterserve cannot do is a 400 naming the field, never a 200 with
unconstrained text:

- `guided_decoding_backend`: only xgrammar runs, so `xgrammar` and `auto` (and null) are
  accepted, any other backend (`outlines`, `guidance`, `lm-format-enforcer`) refused;
- `guided_whitespace_pattern`: JSON whitespace is fixed (compact separators), so any value
  is refused;
- `structural_tag`: refused (xgrammar has structural tags, but vLLM's JSON shape for them is
  not mapped);
- two constraints at once (two guided fields, or one beside `response_format` or
  `structured_outputs`) are refused by the caller, server/openai/structured_output_fields.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from scheduler.sampling_params import StructuredOutput
from server.http.errors import bad_request
from server.openai.protocol import SamplingFields

# The guided fields that are a constraint, and the constraint kind each maps to.
GUIDED_KINDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
}
ACCEPTED_BACKENDS = (None, "auto", "xgrammar")


@dataclass(frozen=True, slots=True)
class GuidedConstraint:
    param: str  # the guided field that gave it, for errors
    constraint: StructuredOutput


def guided_constraint(body: SamplingFields) -> GuidedConstraint | None:
    """The constraint the request's guided fields ask for (None: none given); 400s naming
    the field for what cannot be honoured (the module docstring)."""
    _check_options(body)
    given = {name: getattr(body, name) for name in GUIDED_KINDS}
    given = {name: value for name, value in given.items() if value not in (None, False)}
    if len(given) > 1:
        names = sorted(given)
        raise bad_request(
            f"give one structured-output constraint, not several (got {', '.join(names)})",
            param=names[0],
        )
    if not given:
        return None
    [(name, value)] = given.items()
    kind = GUIDED_KINDS[name]
    if kind == "json_schema":
        spec = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        spec = json.dumps(value)
    elif kind == "json_object":
        spec = ""
    else:
        spec = value
    return GuidedConstraint(name, StructuredOutput(kind, spec))


def _check_options(body: SamplingFields) -> None:
    if body.guided_decoding_backend not in ACCEPTED_BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {body.guided_decoding_backend!r} is not available: "
            "meterserve's one backend is xgrammar (give 'xgrammar', 'auto' or nothing)",
            param="guided_decoding_backend",
            code="unsupported_parameter",
        )
    if body.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported: JSON is generated with fixed compact "
            "whitespace; meterserve refuses it rather than ignoring it",
            param="guided_whitespace_pattern",
            code="unsupported_parameter",
        )
    if body.structural_tag is not None:
        raise bad_request(
            "structural_tag is not supported by this server; use structured_outputs or "
            "guided_grammar (EBNF)",
            param="structural_tag",
            code="unsupported_parameter",
        )
