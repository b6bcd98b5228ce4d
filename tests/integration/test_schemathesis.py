"""Schema-driven fuzzing of the real server: no input gets a 5xx or a dropped connection.

schemathesis reads the server's own /openapi.json (request bodies from the same pydantic
models the routes validate with, server/http/openapi.py) and sends valid and invalid requests to
every operation. The only check is the one the API promises: every answer is a response with
a status below 500. Bounded: a fixed number of examples per operation, generation capped at
a few tokens per request so valid requests stay short, and a time limit on the whole run.
"""

from __future__ import annotations

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from server_process import ServerProcess
from serverproc import API_KEY

pytestmark = pytest.mark.timeout(300)

EXAMPLES_PER_OPERATION = 25
MAX_GENERATED_TOKENS = 4  # a valid request may ask for thousands; the fuzzer needs none
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def fuzz_server(priority_server: ServerProcess) -> ServerProcess:
    """The second server (conftest.py): no fault injection armed, as an injected fault is a
    500 by design."""
    return priority_server


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess):
    return schemathesis.openapi.from_url(
        fuzz_server.base_url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}
    )


def _bounded(body: object, path: str) -> object:
    """Keep valid generation requests short: cap what they may generate, never what they send."""
    if not isinstance(body, dict):
        return body
    for field in LIMIT_FIELDS:
        value = body.get(field)
        if _is_int(value) and value > MAX_GENERATED_TOKENS:
            body[field] = MAX_GENERATED_TOKENS
    if not any(_is_int(body.get(f)) for f in LIMIT_FIELDS):
        # absent or null: the whole context
        limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        body[limit] = MAX_GENERATED_TOKENS
    if _is_int(body.get("n")) and body["n"] > 2:
        body["n"] = 2
    return body


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _operations(api_schema) -> list:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    return operations


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_server_error(api_schema, fuzz_server: ServerProcess, mode):
    """Every operation, valid then invalid inputs. (schemathesis' own pytest plugin does not
    load under pytest 9, so hypothesis drives its strategies directly.)"""
    for operation in _operations(api_schema):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,  # the same examples every run: a failure reproduces
            database=None,
        )
        def run(case):
            _call(case, fuzz_server)

        try:
            run()
        except Unsatisfiable:
            # An operation without parameters or body has no invalid input to make.
            assert mode == GenerationMode.NEGATIVE, operation.label
            assert not operation.body and not list(operation.iter_parameters()), operation.label


def _call(case, server: ServerProcess) -> None:
    if case.body is not None and not isinstance(case.body, (bytes, str)):
        case.body = _bounded(case.body, case.path)
    try:
        response = case.call(
            base_url=server.base_url,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
    except (httpx.HTTPError, OSError, requests.RequestException) as exc:  # dropped connection
        pytest.fail(f"{case.method} {case.path}: no response ({exc!r}) for {case.body!r}")
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {case.body!r}"
    )
