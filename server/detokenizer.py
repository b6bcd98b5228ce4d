"""Incremental detokenization: token ids in, UTF-8-safe text pieces out, stop strings cut.

Two guarantees, kept by `IncrementalDetokenizer`:
- A piece never ends inside a multi-byte character. Text is decoded over a small sliding
  window (prefix_offset .. end); while the window's text ends in U+FFFD the tokens so far
  only hold part of a character, so nothing is released until the next token completes it.
- A stop string is never emitted, even when it spans several tokens. The last
  (longest stop - 1) characters are held back until more text shows they cannot start a
  stop string; on a match the text is cut where the stop string begins.

The concatenation of everything `add()` and `finish()` return equals `text`, so a stream
and a non-streamed response built from the same tokens are identical.
"""

from __future__ import annotations

from typing import Any

# How many prompt tokens seed the window, so the first output token decodes with the
# leading space a SentencePiece tokenizer would otherwise drop.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text: released text, held-back text, and the stop-string check."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in (stop or []) if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context  # window tokens: prompt context, then every output token
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] decode to already-read text
        self._read_offset = len(context)
        self._text = ""  # decoded output text (complete characters only), cut at a stop
        self._released = 0  # len of _text handed out so far
        self.num_tokens = 0  # output tokens consumed
        self.stop_matched: str | None = None

    @property
    def text(self) -> str:
        """All output text released so far."""
        return self._text[: self._released]

    @property
    def stopped(self) -> bool:
        return self.stop_matched is not None

    def add(self, token_ids: list[int]) -> str:
        """Consume new output tokens; return the text that may be shown now."""
        if self.stopped or not token_ids:
            return ""
        self.num_tokens += len(token_ids)
        self._ids.extend(token_ids)
        self._decode_window(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: release held-back text, incomplete characters included."""
        if self.stopped:
            return ""
        self._decode_window(final=True)
        return self._release(final=True)

    def _decode_window(self, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return
        if new_text.endswith(_REPLACEMENT) and not final:
            return  # the last tokens hold part of a character; wait for the rest
        self._text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _release(self, final: bool) -> str:
        if self._stop:
            self._cut_at_stop()
        end = len(self._text)
        if not final and not self.stopped:
            end = max(self._released, end - self._holdback)
        piece = self._text[self._released : end]
        self._released = end
        return piece

    def _cut_at_stop(self) -> None:
        # Only an occurrence overlapping unreleased text can be new (older ones were cut).
        start = max(0, self._released - self._holdback)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            self._text = self._text[: best[0]]
            self.stop_matched = best[1]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)


class TokenTexts:
    """Per-token display strings and raw bytes for logprobs, memoized per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_decoder = _byte_level_decoder(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            cached = (text, self._raw_bytes(token_id, text))
            self._cache[token_id] = cached
        return cached

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                return [int(piece[3:5], 16)]  # SentencePiece byte-fallback token
            if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                return [self._byte_decoder[c] for c in piece]
        return list(text.encode("utf-8"))


def _byte_level_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2 style byte-to-unicode table inverted, when the tokenizer is byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ + repr(decoder):
        return None
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
