"""POST /tokenize and POST /detokenize (vLLM's extension endpoints) with the served tokenizer."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.app_state import get_settings, ready_client, served_model_names, token_texts
from server.http.body import parse_request
from server.http.errors import bad_request
from server.openai.prompts import apply_chat_template, encode_texts
from server.openai.protocol import DetokenizeRequest, TokenizeRequest
from server.openai.request_params import check_model, check_token_ids

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    body = await parse_request(
        request, TokenizeRequest, get_settings(request).max_request_body_bytes
    )
    client = ready_client(request)
    check_model(body.model, served_model_names(request))
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must not be empty", param="messages")
        tokens = await apply_chat_template(client, body.messages, body.add_generation_prompt)
    else:
        [tokens] = await encode_texts(client.tokenizer, [body.prompt], body.add_special_tokens)
    result = {"count": len(tokens), "max_model_len": client.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        # Each token's text on its own, as logprobs show it (vLLM returns vocabulary pieces).
        texts = token_texts(request)
        result["token_strs"] = [texts.text(token_id) for token_id in tokens]
    return result


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    body = await parse_request(
        request, DetokenizeRequest, get_settings(request).max_request_body_bytes
    )
    client = ready_client(request)
    check_model(body.model, served_model_names(request))
    check_token_ids(body.tokens, client.vocab_size, "tokens")
    # Inline on purpose: the Rust decode holds the GIL, so a worker thread would not free the
    # loop (~22 ms for 76k tokens); it would only add a hop.
    return {"prompt": client.tokenizer.decode(body.tokens)}
