"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE) and a SentencePiece
tokenizer built here: UTF-8 safety, stop strings across token boundaries, special tokens, the
first token's leading space, and exact token counts. Every test that takes `tokenizer` runs on
both text sources: tokenizers' DecodeStream (fast tokenizer) and the decode window (slow)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.loader import load_checkpoint
from server.text.detokenizer import (
    IncrementalDetokenizer,
    _StreamSource,
    _WindowSource,
    special_stop_tokens,
)

TEXT = "Hello 世界 🎉 naïve café, the END is near. Ünïcødé → ✓ done"
PROMPT = [1, 4093, 198]  # <|im_start|>user\n
SPECIAL_IDS = [0, 1, 2]  # <|endoftext|>, <|im_start|>, <|im_end|>
WORDS = ["the", "fox", "世界", "🎉", "naïve", "café", "→", "✓", "END", "👩‍👩‍👧", "Ünïcødé", "x"]

SENTENCEPIECE_CORPUS = [
    "Hello world, hello there! The quick brown fox jumps over the lazy dog.",
    "We reached the end of the road and kept going far away.",
]


def sentencepiece_tokenizer(decoder: str = "llama") -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style BPE: "▁" marks a space, characters outside the corpus fall
    back to <0xNN> byte tokens. decoder "llama" is Llama 2's (Replace ▁, ByteFallback, Fuse,
    Strip one leading space); "metaspace" is the Metaspace decoder. Both drop the leading
    space of a lone first token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(SENTENCEPIECE_CORPUS * 10, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(data))
    if decoder == "llama":
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


class WithoutBackend:
    """A tokenizer with its Rust backend hidden, as a slow (Python) tokenizer has none."""

    def __init__(self, tokenizer) -> None:
        self._inner = tokenizer

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str):
        if name in ("backend_tokenizer", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def real_tokenizer():
    return load_checkpoint("default").tokenizer


@pytest.fixture(params=["stream", "window"])
def tokenizer(request, real_tokenizer):
    return real_tokenizer if request.param == "stream" else WithoutBackend(real_tokenizer)


@pytest.fixture(scope="module")
def sp_tokenizer():
    return sentencepiece_tokenizer()


def with_backend(tokenizer, use_backend: bool):
    return tokenizer if use_backend else WithoutBackend(tokenizer)


def feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detok.add([token_id]) for token_id in token_ids] + [detok.finish()]


def test_token_by_token_round_trip_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The text really has tokens that hold only part of a character.
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial, "expected multi-byte characters split across tokens"
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    pieces = feed(detok, ids)
    assert "".join(pieces) == TEXT == detok.text
    assert all("\ufffd" not in piece for piece in pieces)
    assert detok.num_tokens == len(ids) and not detok.stopped


def test_several_tokens_per_add(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    pieces = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [detok.finish()]
    assert "".join(pieces) == TEXT


def test_special_tokens_add_no_text(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2]  # <|im_end|>
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    assert "".join(feed(detok, ids)) == "Hi there"
    assert detok.num_tokens == len(ids)


def stop_across_boundary(tokenizer, text: str) -> str:
    """A 5-character substring of `text` whose characters come from at least two tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ends, decoded = [], ""
    for i in range(len(ids)):
        decoded = tokenizer.decode(ids[: i + 1])
        ends.append(len(decoded))
    for boundary in ends[2:-2]:
        candidate = text[boundary - 2 : boundary + 3]
        if candidate.strip() and text.count(candidate) == 1:
            return candidate
    raise AssertionError("no boundary-spanning stop string found")


def test_stop_string_across_tokens_is_cut_and_not_emitted(tokenizer):
    text = "The quick brown fox jumps over the lazy dog and keeps running far away."
    stop = stop_across_boundary(tokenizer, text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=[stop])
    pieces = []
    for token_id in ids:
        pieces.append(detok.add([token_id]))
        # Nothing emitted so far may contain any part of the stop string past the cut.
        assert stop not in "".join(pieces)
        if detok.stopped:
            break
    pieces.append(detok.finish())
    assert detok.stopped and detok.stop_matched == stop
    assert "".join(pieces) == text[: text.index(stop)] == detok.text
    assert detok.num_tokens < len(ids)  # it stopped early
    assert detok.add(ids[-1:]) == "" and detok.num_tokens < len(ids)


def test_earliest_stop_string_wins(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["delta", "beta"])
    assert "".join(feed(detok, ids)) == "alpha "
    assert detok.stop_matched == "beta"


def test_stop_at_start_gives_empty_text(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["Hello"])
    assert "".join(feed(detok, ids)) == ""
    assert detok.stopped


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("We reached the EN", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["END!"])
    streamed = "".join(detok.add([token_id]) for token_id in ids)
    assert not streamed.endswith("EN")  # "EN" could still become "END!"
    assert streamed + detok.finish() == "We reached the EN"
    assert not detok.stopped


def test_finish_mid_character_emits_replacement(tokenizer):
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    partial = ids[:-1]  # the emoji's last byte-token is missing
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    streamed = "".join(detok.add([token_id]) for token_id in partial)
    assert "\ufffd" not in streamed
    assert (streamed + detok.finish()).endswith("\ufffd")


def test_fast_tokenizer_uses_decode_stream(real_tokenizer):
    # The window is the fallback only: a fast tokenizer must not silently take the slow path.
    assert isinstance(IncrementalDetokenizer(real_tokenizer, PROMPT)._source, _StreamSource)
    slow = IncrementalDetokenizer(WithoutBackend(real_tokenizer), PROMPT)
    assert isinstance(slow._source, _WindowSource)


def chunked(token_ids: list[int], rng: random.Random) -> list[list[int]]:
    """token_ids cut into consecutive chunks of 1-4 tokens (one engine event each)."""
    chunks, i = [], 0
    while i < len(token_ids):
        size = rng.randint(1, 4)
        chunks.append(token_ids[i : i + size])
        i += size
    return chunks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_vocabulary_ids_equal_decode_of_all_ids(tokenizer, skip_special_tokens):
    # Arbitrary ids: byte tokens that split characters or form no valid UTF-8, special tokens.
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    for _ in range(150):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(SPECIAL_IDS))
        detok = IncrementalDetokenizer(tokenizer, PROMPT, skip_special_tokens=skip_special_tokens)
        pieces = [detok.add(chunk) for chunk in chunked(ids, rng)]
        # A released piece never ends inside a character.
        assert not any(piece.endswith("\ufffd") for piece in pieces)
        pieces.append(detok.finish())
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == detok.text == expected
        assert detok.num_tokens == len(ids)


def test_random_text_with_emoji_and_special_tokens_equals_decode(tokenizer):
    rng = random.Random(1)
    for _ in range(100):
        ids: list[int] = []
        for _ in range(rng.randint(1, 12)):
            word = rng.choice(WORDS)
            ids += tokenizer.encode(rng.choice(["", " "]) + word, add_special_tokens=False)
            if rng.random() < 0.2:
                ids.append(rng.choice(SPECIAL_IDS))
        detok = IncrementalDetokenizer(tokenizer, PROMPT)
        pieces = [detok.add([token_id]) for token_id in ids]
        assert all("\ufffd" not in piece for piece in pieces)
        pieces.append(detok.finish())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_num_tokens_stops_at_the_token_that_completes_the_stop_string(tokenizer):
    text = "alpha beta 世界 gamma delta epsilon"
    stop = "界 ga"  # ends inside " gamma", starts inside the 3-token character 界
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The index of the first token whose text completes the stop string.
    completes = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))
    assert completes < len(ids) - 1
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=[stop])
    released = detok.add(ids)  # every token in one event: the count is still exact
    assert detok.stopped and detok.num_tokens == completes + 1
    assert released == text[: text.index(stop)] == detok.text
    assert detok.add(ids[:2]) == "" and detok.finish() == ""
    assert detok.num_tokens == completes + 1


def test_held_back_text_is_released_when_it_cannot_start_a_stop(tokenizer):
    text = "one EN two END three"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["END!"])
    streamed = []
    for token_id in ids:
        streamed.append(detok.add([token_id]))
        shown = "".join(streamed)
        # Only the last len("END!") - 1 characters of the text so far are held back.
        assert text.startswith(shown)
        assert len(tokenizer.decode(ids[: len(streamed)])) - len(shown) <= 3
    assert "".join(streamed) + detok.finish() == text
    assert not detok.stopped and detok.num_tokens == len(ids)


def test_first_output_token_keeps_its_leading_space(sp_tokenizer, real_tokenizer):
    for base in (sp_tokenizer, real_tokenizer):
        prompt = base.encode("Hello", add_special_tokens=False)
        output = base.encode("Hello the fox", add_special_tokens=False)[len(prompt) :]
        for use_backend in (True, False):
            detok = IncrementalDetokenizer(with_backend(base, use_backend), prompt)
            first = detok.add(output[:1])
            assert first == " the"
            assert first + detok.add(output[1:]) + detok.finish() == " the fox"
    # The SentencePiece decoder really drops it for a lone first token.
    lone = sp_tokenizer.encode("Hello the fox", add_special_tokens=False)[1:]
    assert sp_tokenizer.decode(lone) == "the fox"


def test_sentencepiece_byte_fallback_round_trip(sp_tokenizer):
    prompt = sp_tokenizer.encode("Hello", add_special_tokens=False)
    text = " the fox 世界 🎉 far"
    ids = sp_tokenizer.encode("Hello" + text, add_special_tokens=False)[len(prompt) :]
    assert any(p.startswith("<0x") for p in sp_tokenizer.convert_ids_to_tokens(ids))
    for use_backend in (True, False):
        detok = IncrementalDetokenizer(with_backend(sp_tokenizer, use_backend), prompt)
        pieces = [detok.add([token_id]) for token_id in ids] + [detok.finish()]
        assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


def test_prompt_ending_inside_a_character(tokenizer):
    ids = tokenizer.encode("ok 世界 done", add_special_tokens=False)
    starts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    cut = starts[0]  # the prompt holds the first byte-token of 世 only
    detok = IncrementalDetokenizer(tokenizer, ids[:cut])
    pieces = [detok.add([token_id]) for token_id in ids[cut:]] + [detok.finish()]
    # The output token that completes the character releases it whole; no prompt text leaks.
    assert "".join(pieces) == "世界 done"


def test_stream_recovers_when_later_bytes_change_released_text(sp_tokenizer):
    # "h" and "+" decode alone, then 0xC2 0xD1 (no valid UTF-8) turn all four byte tokens into
    # U+FFFD: DecodeStream raises "Invalid prefix"; the detokenizer restarts its stream.
    pieces_in = ["<0x68>", "<0x2B>", "<0xC2>", "<0xD1>", "▁hello"]
    ids = sp_tokenizer.convert_tokens_to_ids(pieces_in)
    detok = IncrementalDetokenizer(
        sp_tokenizer, sp_tokenizer.encode("Hi", add_special_tokens=False)
    )
    pieces = [detok.add([token_id]) for token_id in ids] + [detok.finish()]
    assert "".join(pieces) == detok.text
    assert pieces[:2] == ["h", "+"] and detok.text.endswith(" hello")
    assert detok.num_tokens == len(ids)


def test_empty_prompt_and_empty_add(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add([]) == "" and detok.num_tokens == 0
    ids = tokenizer.encode("Hi 🎉", add_special_tokens=False)
    assert "".join(feed(detok, ids)) == "Hi 🎉"


# ---- vLLM's stop rules: min_tokens, include_stop_str_in_output, the engine's stop token ----


def completing_token(tokenizer, ids: list[int], stop: str, after: int = 0) -> int:
    """The 0-based index of the first token whose text completes a match of `stop` that ends
    past the text of ids[:after]."""
    floor = len(tokenizer.decode(ids[:after]))
    for k in range(after, len(ids)):
        text = tokenizer.decode(ids[: k + 1])
        index = text.find(stop, max(0, floor - len(stop) + 1))
        if index >= 0:
            return k
    raise AssertionError(f"{stop!r} never completes")


def test_min_tokens_passes_over_stop_strings_in_the_first_tokens(tokenizer):
    text = "alpha beta gamma beta delta epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first = completing_token(tokenizer, ids, "beta")
    # A stop string completed by token min_tokens + 1 counts (vLLM) ...
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["beta"], min_tokens=first)
    assert "".join(feed(detok, ids)) == "alpha " and detok.num_tokens == first + 1
    # ... one completed within the first min_tokens tokens does not: the second one stops.
    second = completing_token(tokenizer, ids, "beta", after=first + 1)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["beta"], min_tokens=first + 1)
    pieces = feed(detok, ids)
    assert "".join(pieces) == detok.text == "alpha beta gamma "
    assert detok.stop_matched == "beta" and detok.num_tokens == second + 1
    # The count is exact when every token arrives in one event, too.
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["beta"], min_tokens=first + 1)
    assert detok.add(ids) == "alpha beta gamma " and detok.num_tokens == second + 1


def test_min_tokens_longer_than_the_output_never_stops(tokenizer):
    text = "alpha beta gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["beta"], min_tokens=len(ids))
    pieces = feed(detok, ids)
    assert "".join(pieces) == text and not detok.stopped and detok.num_tokens == len(ids)


def test_a_stop_string_may_start_in_the_min_tokens_text(tokenizer):
    text = "The quick brown fox jumps over the lazy dog and keeps running far away."
    stop = stop_across_boundary(tokenizer, text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    completes = completing_token(tokenizer, ids, stop)
    # Tokens up to the one before the completing token are the min_tokens: the match starts
    # in their text and ends in the next token's, so it counts.
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=[stop], min_tokens=completes)
    assert "".join(feed(detok, ids)) == text[: text.index(stop)]
    assert detok.num_tokens == completes + 1


def test_include_stop_str_in_output_keeps_the_stop_and_holds_nothing_back(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "bet"  # ends inside " beta": the token's text past the stop string is cut
    completes = completing_token(tokenizer, ids, stop)
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=[stop], include_stop_str_in_output=True)
    shown = ""
    for k, token_id in enumerate(ids):
        shown += detok.add([token_id])
        if detok.stopped:
            break
        assert shown == tokenizer.decode(ids[: k + 1])  # nothing held back
    shown += detok.finish()
    assert shown == detok.text == "alpha bet"
    assert detok.stop_matched == stop and detok.num_tokens == completes + 1


def test_include_stop_str_with_min_tokens_and_one_event(tokenizer):
    text = "alpha beta gamma beta delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first = completing_token(tokenizer, ids, "beta")
    second = completing_token(tokenizer, ids, "beta", after=first + 1)
    detok = IncrementalDetokenizer(
        tokenizer, PROMPT, stop=["beta"], min_tokens=first + 1, include_stop_str_in_output=True
    )
    assert detok.add(ids) + detok.finish() == "alpha beta gamma beta"
    assert detok.num_tokens == second + 1


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_engines_stop_token_counts_but_shows_no_text(tokenizer, skip_special_tokens):
    # EOS (<|im_end|>) and an ordinary stop token id ("."), the last token of the event.
    words = tokenizer.encode("Hi there", add_special_tokens=False)
    period = tokenizer.encode(".", add_special_tokens=False)
    assert len(period) == 1
    for stop_token in (2, period[0]):
        for include in (False, True):
            detok = IncrementalDetokenizer(
                tokenizer,
                PROMPT,
                skip_special_tokens=skip_special_tokens,
                include_stop_str_in_output=include,
            )
            text = detok.add(words) + detok.add([stop_token], ends_in_stop_token=True)
            text += detok.finish()
            shown = tokenizer.decode([stop_token], skip_special_tokens=skip_special_tokens)
            assert text == detok.text == "Hi there" + (shown if include else "")
            assert detok.num_tokens == len(words) + 1 and not detok.stopped


def test_a_stop_string_naming_a_special_token(tokenizer):
    assert special_stop_tokens(tokenizer, ["<|im_end|>", "x", "<|im_start|>"]) == {
        2: "<|im_end|>",
        1: "<|im_start|>",
    }
    assert special_stop_tokens(tokenizer, ["im_end"]) == {}
    words = tokenizer.encode("Hi there", add_special_tokens=False)
    for include, expected in ((False, "Hi there"), (True, "Hi there<|im_end|>")):
        detok = IncrementalDetokenizer(
            tokenizer, PROMPT, stop=["<|im_end|>"], include_stop_str_in_output=include
        )
        # The engine stopped on the token (server/openai/request_params.py made it a stop token id).
        text = detok.add(words + [2], ends_in_stop_token=True) + detok.finish()
        assert text == detok.text == expected and detok.num_tokens == len(words) + 1


def test_a_special_token_stop_string_matches_in_text_without_skipping(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2] + ids_of(tokenizer, " more")
    for include, expected in ((False, "Hi there"), (True, "Hi there<|im_end|>")):
        detok = IncrementalDetokenizer(
            tokenizer,
            PROMPT,
            stop=["<|im_end|>"],
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        )
        assert "".join(feed(detok, ids)) == expected
        assert detok.stop_matched == "<|im_end|>" and detok.num_tokens == ids.index(2) + 1


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
