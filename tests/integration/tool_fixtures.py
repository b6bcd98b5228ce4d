"""The two function tools the tool-calling tests (chat and Responses) offer the model, their
question, and the check that a call's arguments validate against its tool's schema."""

from __future__ import annotations

import json

import jsonschema

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 1000},
        "b": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["a", "b"],
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
DESCRIPTIONS = {"get_weather": "Current weather", "add": "Add two numbers"}
QUESTION = [{"role": "user", "content": "What is the weather in Paris? And what is 2 + 3?"}]


def assert_valid_call(name: str, arguments: str) -> None:
    """The call names one of the tools and its JSON arguments satisfy that tool's schema."""
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
