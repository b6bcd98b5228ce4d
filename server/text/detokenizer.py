"""Incremental detokenization: token ids in, UTF-8-safe text pieces out, stop strings cut.

Two guarantees, kept by `IncrementalDetokenizer`:
- A piece never ends inside a multi-byte character. A text source releases a token's text only
  once it ends in a complete character: while the decoded text ends in U+FFFD the tokens so far
  hold part of a character, so nothing is released until a later token completes it.
- A stop string is never emitted, even when it spans several tokens. The last
  (longest stop - 1) characters are held back until more text shows they cannot start a
  stop string; on a match the text is cut where the stop string begins, and the token whose
  text completed the match is the last one consumed. With include_stop_str_in_output the
  text is cut where the stop string ends instead, and nothing is held back (vLLM's rule:
  released text always ends before the end of any later match).

Stop rules, as vLLM's: a stop string counts only when a token after the first `min_tokens`
completes it (the text of those tokens may hold a stop string's start, never its whole); a
request the engine finished on a stop token (EOS or a stop token id) does not show that
token's text unless include_stop_str_in_output is set. A stop string that is exactly a
special token's text (say "<|im_end|>", which skip_special_tokens hides from the text) is a
stop token id for the engine (`special_stop_tokens`, server/openai/request_params.py), and with
include_stop_str_in_output its text is shown as the stop string.

The text source is tokenizers' `DecodeStream` (one call into Rust per token) for a fast
tokenizer, and a sliding window decoded twice per token through `tokenizer.decode` for a slow
one (or one that cleans up spaces, which only `tokenizer.decode` does). Both are seeded with the
end of the prompt, so the first output token decodes in context: a SentencePiece decoder drops
the leading space of a lone first token.

The concatenation of everything `add()` and `finish()` return equals `text`, so a stream
and a non-streamed response built from the same tokens are identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from server.text.token_texts import TokenTexts, rust_tokenizer

__all__ = ["IncrementalDetokenizer", "TextOptions", "TokenTexts", "special_stop_tokens"]

# How many prompt tokens seed a text source, so the first output token decodes with the
# leading space a SentencePiece tokenizer would otherwise drop.
_PROMPT_CONTEXT_TOKENS = 5
# UTF-8 holds a character in at most 4 bytes, so a prompt ends in at most 3 tokens of a
# character it does not finish.
_MAX_PARTIAL_TOKENS = 3
_REPLACEMENT = "\ufffd"
_INVALID_PREFIX = "Invalid prefix"  # DecodeStream's error when decoded text is not monotonic

Decode = Callable[[list[int]], str]


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How one API request's output text is made and cut (vLLM's field names)."""

    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


def special_stop_tokens(tokenizer: Any, stop: list[str] | tuple[str, ...]) -> dict[int, str]:
    """token id -> stop string, for each stop string that is exactly a special token's text.

    Decoding with skip_special_tokens drops such a token's text, so the string never shows
    up to be matched; the engine stops on the token instead.
    """
    wanted = set(stop)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {
        int(token_id): token.content
        for token_id, token in added.items()
        if getattr(token, "special", False) and token.content in wanted
    }


class IncrementalDetokenizer:
    """One request's output text: released text, held-back text, and the stop-string check.

    `num_tokens` counts the output tokens consumed: every token given to `add()` up to and
    including the one whose text completed a stop string (or the engine's stop token); after
    a stop, none. Invariant: _released <= len(_text), and no stop string ends inside
    _text[:_checked] past the first min_tokens tokens' text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | tuple[str, ...] | None = None,
        skip_special_tokens: bool = True,
        *,
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._source = _text_source(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = [s for s in (stop or []) if s]
        self._min_tokens = min_tokens
        self._include_stop = include_stop_str_in_output
        longest = max((len(s) for s in self._stop), default=1)
        self._holdback = 0 if include_stop_str_in_output else longest - 1
        # A stop token's text when shown: the special tokens skip_special_tokens would hide.
        self._stop_token_texts = (
            special_stop_tokens(tokenizer, self._stop)
            if include_stop_str_in_output and skip_special_tokens
            else {}
        )
        self._text = ""  # decoded output text (complete characters only), cut at a stop
        self._checked = 0  # no new match can end inside _text[:_checked]
        self._released = 0  # len of _text handed out so far
        self.num_tokens = 0  # output tokens consumed
        self.stop_matched: str | None = None

    @classmethod
    def for_options(
        cls, tokenizer: Any, prompt_token_ids: list[int], options: TextOptions
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            options.stop,
            options.skip_special_tokens,
            min_tokens=options.min_tokens,
            include_stop_str_in_output=options.include_stop_str_in_output,
        )

    @property
    def text(self) -> str:
        """All output text released so far."""
        return self._text[: self._released]

    @property
    def stopped(self) -> bool:
        return self.stop_matched is not None

    def add(self, token_ids: list[int], ends_in_stop_token: bool = False) -> str:
        """Consume new output tokens; return the text that may be shown now.

        `ends_in_stop_token`: the engine finished the request on the last of `token_ids` (EOS
        or a stop token id). That token is consumed, but its text is shown only with
        include_stop_str_in_output (as vLLM). `finish()` follows.
        """
        if self.stopped:
            return ""
        last = len(token_ids) - 1
        for i, token_id in enumerate(token_ids):
            self.num_tokens += 1
            if ends_in_stop_token and i == last:
                if self._include_stop:
                    self._append(self._stop_token_text(token_id))
                break
            self._append(self._source.step(token_id))
            if self.stopped:
                break
        return self._release(final=False)

    def _stop_token_text(self, token_id: int) -> str:
        text = self._stop_token_texts.get(token_id)
        return text if text is not None else self._source.step(token_id)

    def finish(self) -> str:
        """The request ended: release held-back text, incomplete characters included."""
        if self.stopped:
            return ""
        self._append(self._source.flush())
        return self._release(final=True)

    def _append(self, piece: str) -> None:
        if not piece:
            return
        self._text += piece
        # Text of the first min_tokens tokens is passed over: a match must end after it.
        if self._stop and self.num_tokens > self._min_tokens:
            self._cut_at_stop()
        if not self.stopped:
            self._checked = len(self._text)

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if not final and not self.stopped:
            end = max(self._released, end - self._holdback)
        piece = self._text[self._released : end]
        self._released = end
        return piece

    def _cut_at_stop(self) -> None:
        # A new match ends past _checked, so it starts at or after _checked - len(stop) + 1.
        # The earliest start wins.
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, max(0, self._checked - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            index, stop = best
            self._text = self._text[: index + len(stop) if self._include_stop else index]
            self.stop_matched = stop


class _StreamSource:
    """Text from tokenizers' `DecodeStream`: the stream keeps its own window in Rust.

    `_context` is the ids of the last piece the stream released (or the prompt seed) and
    `_pending` the ids stepped since, whose text is not complete yet; `flush()` decodes the
    pending ids in that context, and a stream whose state broke restarts from them.
    """

    def __init__(self, backend: Tokenizer, context: list[int], skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._context = context
        self._pending: list[int] = []

    def step(self, token_id: int) -> str:
        self._pending.append(token_id)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # A later token changed text already released (byte-fallback tokens that form
            # no valid UTF-8 decode to U+FFFD together): the stream cannot go on from its
            # prefix. Restart it on the pending tokens alone (vLLM restarts on the current
            # one only): an empty stream has no prefix to contradict.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            piece = self._stream.step(self._backend, self._pending)
        if piece is None:
            return ""
        self._context, self._pending = self._pending, []
        return piece

    def flush(self) -> str:
        if not self._pending:
            return ""
        prefix = self._decode(self._context)
        return self._decode(self._context + self._pending)[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special)


class _WindowSource:
    """Text from `tokenizer.decode` over a sliding window: ids[prefix_offset:read_offset]
    decode to text already released; ids[read_offset:] are the tokens not yet released."""

    def __init__(self, decode: Decode, context: list[int]) -> None:
        self._decode = decode
        self._ids = list(context)  # window tokens: prompt context, then every output token
        self._prefix_offset = 0
        self._read_offset = len(context)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._decode_window(final=False)

    def flush(self) -> str:
        return self._decode_window(final=True)

    def _decode_window(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # no new text, or the last tokens hold part of a character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


def _text_source(
    tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool
) -> _StreamSource | _WindowSource:
    backend = rust_tokenizer(tokenizer)
    source: _StreamSource | _WindowSource
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):

        def decode(token_ids: list[int]) -> str:
            if not token_ids:
                return ""
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

        end = _seed_end(decode, prompt_token_ids)
        source = _WindowSource(decode, _seed(prompt_token_ids, end))
    else:

        def backend_decode(token_ids: list[int]) -> str:
            return backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

        end = _seed_end(backend_decode, prompt_token_ids)
        source = _StreamSource(backend, _seed(prompt_token_ids, end), skip_special_tokens)
    for token_id in prompt_token_ids[end:]:
        source.step(token_id)  # the start of a character the output finishes; not output
    return source


def _seed_end(decode: Decode, prompt_token_ids: list[int]) -> int:
    """Where the prompt's last complete character ends.

    prompt[end:] (at most 3 tokens) hold the start of a character the prompt does not finish.
    A seed ending inside a character would make the stream release the seed's own text, so
    those tokens are stepped after the seed instead, and the output token that completes the
    character releases it whole.
    """
    end = len(prompt_token_ids)
    while (
        end > 0
        and len(prompt_token_ids) - end < _MAX_PARTIAL_TOKENS
        and decode(_seed(prompt_token_ids, end)).endswith(_REPLACEMENT)
    ):
        end -= 1
    return end


def _seed(prompt_token_ids: list[int], end: int) -> list[int]:
    return list(prompt_token_ids[max(0, end - _PROMPT_CONTEXT_TOKENS) : end])
