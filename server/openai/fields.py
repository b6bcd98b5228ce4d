"""Which OpenAI request fields meterserve honours, refuses, or accepts and ignores.

Every field OpenAI defines for an endpoint is in exactly one of three sets (docs/api.md shows
the table; tests/unit/test_openai_fields.py checks it against these sets and the models):

- honoured: a field of our request model that changes what is computed;
- refused: a field we cannot honour; sending it with a value other than its no-op default is
  a 400 naming it (never silently dropped: a client relying on it must learn it is not done);
- ignored: a field that cannot change the output (`user`, `metadata`, `store`, ...): accepted.

A field OpenAI does not define (a client's or another server's extension) is accepted and
ignored with a warning in the log, as vLLM's OpenAI server does, so clients written for other
servers keep working; the warning names it so an operator can see what is being dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from server.http.errors import bad_request

log = logging.getLogger(__name__)

IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)

# Refused fields and the values that are no-ops (sending those is fine).
_NOT_SET: tuple[Any, ...] = (None,)
CHAT_REFUSED: Mapping[str, tuple[Any, ...]] = {
    # Deprecated forms of tools / tool_choice; those two are honoured (server/tool_calls).
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": _NOT_SET,
    "modalities": (None, ["text"]),
    "prediction": _NOT_SET,
    "web_search_options": _NOT_SET,
    "reasoning_effort": _NOT_SET,
    "verbosity": _NOT_SET,
}
COMPLETIONS_REFUSED: Mapping[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}

CHAT_HONOURED = frozenset(
    {
        "messages", "model", "frequency_penalty", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "n", "presence_penalty", "seed", "stop",
        "stream", "stream_options", "temperature", "top_logprobs", "top_p", "response_format",
        "tools", "tool_choice", "parallel_tool_calls",
    }
)  # fmt: skip
COMPLETIONS_HONOURED = frozenset(
    {
        "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
        "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature",
        "top_p",
    }
)  # fmt: skip

# POST /v1/responses (server/openai/protocol/responses.py). previous_response_id and conversation
# need stored state: refused with a message saying meterserve is stateless.
RESPONSES_HONOURED = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
        "stream", "text", "tools", "tool_choice", "parallel_tool_calls",
    }
)  # fmt: skip
RESPONSES_REFUSED: Mapping[str, tuple[Any, ...]] = {
    "previous_response_id": _NOT_SET,
    "conversation": _NOT_SET,
    "max_tool_calls": _NOT_SET,
    "reasoning": (None, {}),
    "include": (None, []),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),  # disabled: a prompt that does not fit is a 400
    "background": (None, False),
    "prompt": _NOT_SET,  # a stored prompt template
    "context_management": (None, []),
    "moderation": _NOT_SET,
}
# Beyond IGNORED: stream obfuscation only pads events, the prompt-cache options tune a cache
# meterserve keys by content, and the image and access options apply to inputs it refuses.
RESPONSES_IGNORED = IGNORED | {
    "stream_options", "prompt_cache_retention", "prompt_cache_options", "image",
    "background_options", "access_programs",
}  # fmt: skip
# vLLM's structured-output extensions: honoured on chat and completions
# (server/openai/guided_decoding.py); a Responses request constrains its output through
# `text.format`.
RESPONSES_EXTENSIONS_REFUSED: Mapping[str, tuple[Any, ...]] = dict.fromkeys(
    ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
     "guided_json_object", "guided_decoding_backend", "guided_whitespace_pattern"),
    _NOT_SET,
)  # fmt: skip
# Fields of `text` beyond `format`.
RESPONSES_TEXT_REFUSED: Mapping[str, tuple[Any, ...]] = {"verbosity": _NOT_SET}

# OpenAI's fields of one message in `messages`, beyond role/content/name and the honoured
# tool_calls / tool_call_id.
MESSAGE_REFUSED: Mapping[str, tuple[Any, ...]] = {
    "function_call": _NOT_SET,
    "audio": _NOT_SET,
    "refusal": (None, ""),
}


def check_extra_fields(
    extra: Mapping[str, Any] | None,
    refused: Mapping[str, tuple[Any, ...]],
    where: str,
    param: str | None = None,
) -> None:
    """Refuse (400, naming it) a refused field given a value other than its no-op; log the
    fields OpenAI does not define. `where` names the object in messages ("request",
    "messages[2]"); `param` is the error's param (the field itself when None)."""
    extra = extra or {}
    for name, no_ops in refused.items():
        if name in extra and not any(extra[name] == no_op for no_op in no_ops):
            raise bad_request(
                f"{name} (in {where}) is not supported by this server; meterserve refuses it "
                "rather than ignoring it (docs/api.md lists every field)",
                param=param or name,
                code="unsupported_parameter",
            )
    unknown = sorted(set(extra) - IGNORED - set(refused))
    if unknown:
        log.warning("%s: ignoring fields OpenAI does not define: %s", where, ", ".join(unknown))
