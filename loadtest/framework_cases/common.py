"""What every case shares: the prompts, tools and pydantic models, the context a case runs
in (its clients, its exchanged bodies), and the checks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel

MAX_TOKENS = 200
BODY_CHARS = 3000  # of each request and response kept for a failed case
SAMPLING: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS}
WEATHER = "What is the weather like in Paris today? Use the get_weather tool."
TIME = "What time is it in Tokyo? Use the get_time tool."
PERSON = (
    "Extract the person from this sentence as JSON with the keys name (a string) and age "
    "(an integer): Alice Martin is 31 years old and lives in Lyon."
)


class CaseFailed(Exception):
    """The framework call completed but its result does not have the expected shape."""


class WeatherArgs(BaseModel):
    city: str


class TimeArgs(BaseModel):
    timezone: str


class Person(BaseModel):
    name: str
    age: int


class Attendee(BaseModel):
    name: str
    role: Literal["host", "guest"]


class Meeting(BaseModel):
    """Nested, with an enum, an array and an optional field: $defs and anyOf in its schema."""

    title: str
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    attendees: list[Attendee]
    room: str | None = None


MEETING = (
    "Extract the meeting as JSON: 'Budget review' on Tuesday, hosted by Ana, with the guests "
    "Bo and Cy; the room is not known yet."
)
TOOL_ARGS: dict[str, type[BaseModel]] = {"get_weather": WeatherArgs, "get_time": TimeArgs}
TOOL_SPECS = (
    ("get_weather", "Get the current weather in a city.", "city", "The city, e.g. Paris"),
    (
        "get_time",
        "Get the current time in a time zone.",
        "timezone",
        "An IANA zone, e.g. Asia/Tokyo",
    ),
)
FUNCTIONS = [
    {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {arg: {"type": "string", "description": arg_doc}},
            "required": [arg],
        },
    }
    for name, description, arg, arg_doc in TOOL_SPECS
]
CHAT_TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
RESPONSES_TOOLS = [{"type": "function", **f} for f in FUNCTIONS]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass(slots=True)
class CaseContext:
    """One case's server, model and clients; every request and response the case's clients
    exchange is recorded in `exchanges` (bodies truncated), so a failure can be replayed."""

    base_url: str
    model: str
    api_key: str
    timeout_s: float
    exchanges: list[dict[str, Any]] = field(default_factory=list)

    def _on_request(self, request: httpx.Request) -> None:
        body = request.content.decode(errors="replace")[:BODY_CHARS]
        self.exchanges.append({"request": f"{request.method} {request.url.path}", "body": body})

    def _on_response(self, response: httpx.Response) -> None:
        response.read()  # a stream too: the client then reads the buffered body
        self._keep(response)

    async def _on_async_response(self, response: httpx.Response) -> None:
        await response.aread()
        self._keep(response)

    def _keep(self, response: httpx.Response) -> None:
        if self.exchanges:
            self.exchanges[-1]["status"] = response.status_code
            self.exchanges[-1]["response"] = response.text[:BODY_CHARS]

    def http_client(self) -> httpx.Client:
        hooks = {"request": [self._on_request], "response": [self._on_response]}
        return httpx.Client(timeout=self.timeout_s, event_hooks=hooks, trust_env=False)

    def http_async_client(self) -> httpx.AsyncClient:
        async def on_request(request: httpx.Request) -> None:
            self._on_request(request)

        hooks = {"request": [on_request], "response": [self._on_async_response]}
        return httpx.AsyncClient(timeout=self.timeout_s, event_hooks=hooks, trust_env=False)

    def openai(self) -> Any:
        from openai import OpenAI

        return OpenAI(**self._client_args(), http_client=self.http_client())

    def async_openai(self) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(**self._client_args(), http_client=self.http_async_client())

    def _client_args(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "api_key": self.api_key,
            "timeout": self.timeout_s,
            "max_retries": 0,
        }


def expect(condition: object, reason: str) -> None:
    if not condition:
        raise CaseFailed(reason)


def check_call(name: str, arguments: str | dict, forced: str | None = None) -> str:
    """A tool call names a declared tool (the forced one if given) with arguments valid
    against its schema; returns `name(arguments)` for the detail."""
    expect(name in TOOL_ARGS, f"call to undeclared tool {name!r}")
    expect(forced is None or name == forced, f"called {name!r}, forced {forced!r}")
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    TOOL_ARGS[name].model_validate(args)
    return f"{name}({json.dumps(args)[:60]})"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]
