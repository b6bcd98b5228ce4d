"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE): UTF-8 safety,
stop strings across token boundaries, special tokens, and per-token logprob strings."""

from __future__ import annotations

import pytest

from engine.loader import load_checkpoint
from server.detokenizer import IncrementalDetokenizer, TokenTexts

TEXT = "Hello 世界 🎉 naïve café, the END is near. Ünïcødé → ✓ done"
PROMPT = [1, 4093, 198]  # <|im_start|>user\n


@pytest.fixture(scope="module")
def tokenizer():
    return load_checkpoint("default").tokenizer


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


def test_token_texts_and_raw_bytes(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("Hello 🎉", add_special_tokens=False)
    assert b"".join(bytes(texts.bytes(i)) for i in ids) == "Hello 🎉".encode()
    assert texts.text(ids[0]) == "Hello"
    assert texts.text(2) == "<|im_end|>"
