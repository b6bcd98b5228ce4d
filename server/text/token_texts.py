"""Token strings and raw bytes for logprobs: what one token id stands for on its own.

`decode([id])` gets a lone token wrong in two ways: a SentencePiece decoder strips the leading
space of the first token ("▁the" -> "the"), and a token holding part of a UTF-8 character
decodes to U+FFFD. So a token's bytes come from its vocabulary piece instead:
- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): each character of the piece stands for one
  byte through GPT-2's byte-to-unicode table ("Ġthe" -> b" the");
- SentencePiece (Llama 2, Mistral, Gemma): "▁" stands for a space ("▁the" -> b" the") and a
  byte-fallback piece "<0xE2>" for that one raw byte;
- added tokens (special or not) are their content as written ("<|im_end|>");
- any other vocabulary (WordPiece, ...) falls back to `decode([id])`.
`text` is the bytes decoded as UTF-8, with U+FFFD for an incomplete character, so `bytes` is
`text.encode()` whenever the token holds whole characters, and the bytes of consecutive tokens
join to the UTF-8 of the text they decode to.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tokenizers import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "▁"  # U+2581, SentencePiece's space


def rust_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a fast (Rust-backed) transformers tokenizer, else None."""
    for name in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


class _Vocab(Enum):
    """How a vocabulary piece spells its bytes."""

    BYTE_LEVEL = "byte_level"  # one character per byte, GPT-2's table
    SENTENCEPIECE = "sentencepiece"  # text with a space marker, <0xNN> byte fallback
    OTHER = "other"  # ask the tokenizer's decode


@dataclass(frozen=True, slots=True)
class _TokenText:
    text: str
    raw: list[int]  # the token's bytes


class TokenTexts:
    """Per-token display strings and raw bytes for logprobs, memoized per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = rust_tokenizer(tokenizer)
        steps = _decoder_steps(self._backend)
        self._vocab = _vocabulary_kind(tokenizer, self._backend, steps)
        self._space = _space_marker(steps) or _SPIECE_SPACE
        self._byte_decoder = _byte_level_table() if self._vocab is _Vocab.BYTE_LEVEL else {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: token.content for i, token in added.items()}
        self._cache: dict[int, _TokenText] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id).text

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id).raw

    def _lookup(self, token_id: int) -> _TokenText:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._raw_bytes(token_id)
            cached = _TokenText(raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = cached
        return cached

    def _raw_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        if self._vocab is _Vocab.OTHER:
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        piece = self._piece(token_id)
        if piece is None:
            return b""  # an id past the tokenizer's vocabulary (a padded embedding row)
        if self._vocab is _Vocab.BYTE_LEVEL:
            if all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            return piece.encode()  # not a byte-level piece: as written
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace(self._space, " ").encode()

    def _piece(self, token_id: int) -> str | None:
        if self._backend is not None:
            return self._backend.id_to_token(token_id)
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        return piece if isinstance(piece, str) else None


def _vocabulary_kind(tokenizer: Any, backend: Tokenizer | None, steps: list[dict]) -> _Vocab:
    if backend is None:  # a slow (Python) tokenizer: tell by what it carries
        if hasattr(tokenizer, "byte_decoder"):
            return _Vocab.BYTE_LEVEL
        return _Vocab.SENTENCEPIECE if hasattr(tokenizer, "sp_model") else _Vocab.OTHER
    if any(step.get("type") == "ByteLevel" for step in steps):
        return _Vocab.BYTE_LEVEL
    return _Vocab.SENTENCEPIECE if _space_marker(steps) is not None else _Vocab.OTHER


def _decoder_steps(backend: Tokenizer | None) -> list[dict]:
    """The backend's decoder as a flat list of its JSON steps ([] when it has none)."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return []
    steps, todo = [], [json.loads(decoder.__getstate__())]
    while todo:
        step = todo.pop(0)
        if step.get("type") == "Sequence":
            todo[:0] = step.get("decoders", [])
        else:
            steps.append(step)
    return steps


def _space_marker(steps: list[dict]) -> str | None:
    """The character a SentencePiece-style decoder turns into a space, if it has one."""
    for step in steps:
        if step.get("type") == "Metaspace":
            return step.get("replacement", _SPIECE_SPACE)
        if step.get("type") == "Replace" and step.get("content") == " ":
            pattern = step.get("pattern", {}).get("String")
            if pattern:
                return pattern
    return None


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: piece character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_values = printable[:]
    code_points = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            code_points.append(256 + extra)
            extra += 1
    return {chr(cp): b for b, cp in zip(byte_values, code_points, strict=True)}
