"""Compiling a request's grammar ahead, before it is submitted: off the event loop and out
of every engine step.

A route's constraint (server/openai/structured_output_fields.py, the tool-call grammar of
server/tool_calls/constraint.py) goes to the engine's compile worker
(StructuredOutputs.compile_async, engine/structured_output.py); the route awaits it with a
timeout, so by the time the request reaches the engine its grammar is cached and masking
its first row compiles nothing. The seconds compiled are billed to that request
(server/engine_client/request_group.py charge_grammar_compile), never to a batch.
"""

from __future__ import annotations

import asyncio

from engine.structured_output import CompileQueueFull, StructuredOutputError, StructuredOutputs
from scheduler.sampling_params import StructuredOutput
from server.engine_client.request_group import charge_grammar_compile
from server.http.errors import OpenAIError, bad_request

# A schema, regex or grammar longer than this is a 400: compile time and the compiled
# grammar's memory grow with it (a 400-property schema with a pattern each is ~30 K chars).
MAX_GRAMMAR_SPEC_CHARS = 64 * 1024
# How long a request waits for its grammar (compiled in line behind other requests' on the
# one worker) before it is a 400.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


def check_spec_size(num_chars: int, param: str, what: str) -> None:
    if num_chars > MAX_GRAMMAR_SPEC_CHARS:
        raise bad_request(
            f"{what} is {num_chars} characters; at most {MAX_GRAMMAR_SPEC_CHARS} are compiled",
            param=param,
        )


async def compile_ahead(
    constraint: StructuredOutput, structured: StructuredOutputs, param: str, problem: str
) -> None:
    """Compile `constraint` on the engine's compile worker and charge the seconds to the
    request. A 400 naming `param` ("<problem>: <why>") when it does not compile, or not
    within GRAMMAR_COMPILE_TIMEOUT_S (the compile goes on and is cached: other requests may
    be waiting on the same one; a 429 when the worker already has MAX_PENDING_COMPILES)."""
    try:
        future = asyncio.wrap_future(structured.compile_async(constraint))
    except CompileQueueFull as exc:
        raise OpenAIError(
            429, str(exc), code="grammar_compile_queue_full", headers={"Retry-After": "5"}
        ) from None
    try:
        # shield: a timeout must not cancel a compile other requests share.
        compiled = await asyncio.wait_for(asyncio.shield(future), GRAMMAR_COMPILE_TIMEOUT_S)
    except TimeoutError:
        raise bad_request(
            f"{problem}: the grammar did not compile within {GRAMMAR_COMPILE_TIMEOUT_S:g} s",
            param=param,
        ) from None
    except StructuredOutputError as exc:
        raise bad_request(f"{problem}: {exc}", param=param) from None
    charge_grammar_compile(compiled.compile_seconds)
