"""The size of everything a client controls, bounded before any work is done for it.

One tenant must not be able to stall the others with one request: each size below is checked at the
HTTP edge (a 400 naming the field) before tokenizing, templating or admission, and the work that
remains per request is done once per request, not once per choice (one parsed LogitBias, one stop
list, shared by every choice: server/openai/request_params.py). docs/api.md lists them.

The request body itself is capped by --max-request-body-bytes (413), the prompt by the
context (400 context_length_exceeded), choices per request by --max-choices-per-request, and
a grammar's spec and compile time by server/openai/grammar_compile.py (MAX_GRAMMAR_SPEC_CHARS,
GRAMMAR_COMPILE_TIMEOUT_S; engine/structured_output.py bounds the compiles queued at once).
"""

from __future__ import annotations

from typing import Any

from scheduler.logit_bias import LogitBias
from server.http.errors import bad_request

MAX_N = 16  # choices per prompt (`n`); each choice is one engine request
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1_024  # each stop string is matched against every choice's text
MAX_STOP_TOKEN_IDS = 1_024
MAX_TOOLS = 128  # OpenAI's limit
MAX_CACHE_SALT_CHARS = 256
# logit_bias: at most one entry per token of the vocabulary (the keys are unique token ids).


def check_num_choices(num_prompts: int, n: int, max_choices: int, prompt_param: str) -> None:
    """n x prompts engine requests from one API request: at most --max-choices-per-request."""
    if num_prompts * n > max_choices:
        raise bad_request(
            f"this request asks for {num_prompts * n} choices ({num_prompts} prompt(s) x n={n}); "
            f"this server allows at most {max_choices} per request (--max-choices-per-request)",
            param="n" if n > 1 else prompt_param,
        )


def parse_logit_bias(raw: Any) -> LogitBias | None:
    """OpenAI's {"token id": bias} object as a LogitBias (pydantic calls it while validating
    the body, off the event loop for a large body); ValueError names the bad entry. The
    vocabulary range is checked later, in O(1), by check_logit_bias_range."""
    if raw is None or isinstance(raw, LogitBias):
        return raw
    # ValueError, not TypeError, throughout: pydantic turns only ValueError into a 400
    # naming the field.
    if not isinstance(raw, dict):
        raise ValueError("logit_bias must be an object of token id -> bias")  # noqa: TRY004
    pairs = []
    for key, bias in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.strip().isdigit()):
            raise ValueError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ValueError(f"logit_bias values must be numbers, got {bias!r} for {key!r}")  # noqa: TRY004
        pairs.append((int(key), float(bias)))
    return LogitBias.of(pairs)


def check_logit_bias_range(bias: LogitBias | None, vocab_size: int) -> LogitBias | None:
    """400 when a biased token id is not in the model's vocabulary (ids are sorted)."""
    if bias and bias.token_ids[-1] >= vocab_size:
        raise bad_request(
            f"logit_bias token id {bias.token_ids[-1]} is out of range [0, {vocab_size})",
            param="logit_bias",
        )
    return bias
