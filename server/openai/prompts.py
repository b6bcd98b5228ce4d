"""A request's prompts as token ids: a conversation rendered by the tokenizer's chat template
(chat completions, Responses, /tokenize) or completions' prompt tokenized, either one off the
event loop when it is long enough to stall it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from server.engine_client.client import EngineClient
from server.http.errors import bad_request
from server.openai.protocol import ChatMessage, PromptInput
from server.openai.request_limits import MAX_PROMPTS
from server.openai.request_params import check_token_ids
from server.tool_calls import FunctionTool, conversation_for_template

# Up to this many characters the tokenizer runs inline: it blocks the event loop for well under
# a millisecond (~0.5 ms for 1,000 characters with SmolLM2's tokenizer on 2 busy cores), and a
# hop to a worker thread (~130 us) would cost a short prompt more than tokenizing it.
INLINE_TOKENIZE_CHARS = 1_000

T = TypeVar("T")


def num_prompts(prompt: PromptInput) -> int:
    """How many prompts `prompt` holds (a string or a list of token ids is one)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def tokenize_prompts(prompt: PromptInput, client: EngineClient) -> list[list[int]]:
    """The request's prompts as token ids (a list of token ids is one prompt)."""
    if isinstance(prompt, str):
        prompts = await encode_texts(client.tokenizer, [prompt])
    elif not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], str):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        prompts = await encode_texts(client.tokenizer, prompt)
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    for ids in prompts:
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        check_token_ids(ids, client.vocab_size, "prompt")
    return prompts


async def encode_texts(
    tokenizer: Any, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each text, tokenized off the event loop when the texts are long."""

    def encode() -> list[list[int]]:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    return await off_loop(encode, sum(len(t) for t in texts))


async def off_loop(work: Callable[[], T], num_chars: int) -> T:
    """`work()` (tokenizing or rendering `num_chars` characters), in a worker thread when that
    is long enough to stall the event loop. A fast tokenizer releases the GIL while it encodes,
    so the loop keeps streaming other requests' tokens meanwhile; an error raised by `work`
    (a 400 for a bad prompt) reaches the caller the same either way."""
    if num_chars <= INLINE_TOKENIZE_CHARS:
        return work()
    return await asyncio.to_thread(work)


async def apply_chat_template(
    client: EngineClient,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: Sequence[FunctionTool] = (),
) -> list[int]:
    """Render messages (and tools, with their tool-call history) with the tokenizer's chat
    template, then tokenize the text as is; both off the event loop when the messages are
    long."""
    tokenizer = client.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    conversation, tools_arg = conversation_for_template(
        [_turn(m) for m in messages], tools, template
    )
    extra = {} if tools_arg is None else {"tools": tools_arg}

    def render() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the user's
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None
        # The template already holds the special tokens (BOS, role markers): add none.
        return tokenizer.encode(text, add_special_tokens=False)

    return await off_loop(render, sum(len(turn["content"]) for turn in conversation))


def _turn(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (OpenAI's shape; developer is system)."""
    turn: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn
