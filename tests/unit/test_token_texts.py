"""The server's tokenizer work at the edge: exact token strings and bytes for logprobs
(byte-level BPE, SentencePiece, other vocabularies), and long prompts tokenized off the event
loop with the same results and errors as inline."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from test_detokenizer import sentencepiece_tokenizer
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from engine.loader import load_checkpoint
from server.http.errors import OpenAIError
from server.openai.prompts import INLINE_TOKENIZE_CHARS, apply_chat_template, tokenize_prompts
from server.openai.protocol import ChatMessage
from server.text.token_texts import TokenTexts

LONG_PROMPT = ("The quick brown fox jumps over the lazy dog. 世界 🎉 " * 5_000)[:200_000]


@pytest.fixture(scope="module")
def tokenizer():
    return load_checkpoint("default").tokenizer


def joined_bytes(texts: TokenTexts, token_ids: list[int]) -> bytes:
    return b"".join(bytes(texts.bytes(token_id)) for token_id in token_ids)


def test_token_texts_and_raw_bytes(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("Hello 🎉", add_special_tokens=False)
    assert joined_bytes(texts, ids) == "Hello 🎉".encode()
    assert texts.text(ids[0]) == "Hello"
    assert texts.text(2) == "<|im_end|>"


def test_byte_level_strings_are_the_bytes_each_token_stands_for(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(" world 世界 café", add_special_tokens=False)
    assert texts.text(ids[0]) == " world" and texts.bytes(ids[0]) == list(b" world")
    assert joined_bytes(texts, ids) == " world 世界 café".encode()
    partial = [i for i in ids if texts.text(i).endswith("\ufffd")]
    assert partial and all(len(texts.bytes(i)) < 3 for i in partial)  # part of 世 or 界
    # A byte-level decoder adds and drops nothing, so a lone decode is the exact string.
    rng = random.Random(0)
    for token_id in rng.sample(range(len(tokenizer)), 3_000) + [0, 1, 2]:
        text = texts.text(token_id)
        assert text == tokenizer.decode([token_id], skip_special_tokens=False)
        raw = bytes(texts.bytes(token_id))
        assert raw.decode("utf-8", errors="replace") == text
        if "\ufffd" not in text:
            assert raw == text.encode()


@pytest.mark.parametrize("decoder", ["llama", "metaspace"])
def test_sentencepiece_strings_keep_the_leading_space(decoder):
    sp = sentencepiece_tokenizer(decoder)
    texts = TokenTexts(sp)
    ids = sp.encode("Hello the fox", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(ids[1]) == "▁the"
    assert sp.decode([ids[1]]) == "the"  # a lone decode drops the space
    assert [texts.text(i) for i in ids] == [" Hello", " the", " fox"]
    assert texts.bytes(ids[1]) == list(b" the")
    assert texts.text(sp.eos_token_id) == "</s>"


def test_sentencepiece_byte_fallback_tokens_give_their_raw_byte():
    sp = sentencepiece_tokenizer("llama")
    texts = TokenTexts(sp)
    ids = sp.encode("the 世界🎉", add_special_tokens=False)
    byte_ids = [i for i, p in zip(ids, sp.convert_ids_to_tokens(ids), strict=True) if "<0x" in p]
    assert len(byte_ids) == 10  # 3 + 3 + 4 bytes, none in the vocabulary
    first = sp.convert_tokens_to_ids("<0xE4>")
    assert texts.bytes(first) == [0xE4] and texts.text(first) == "\ufffd"
    assert joined_bytes(texts, ids) == " the 世界🎉".encode()


def test_other_vocabularies_fall_back_to_decode():
    vocab = {"[UNK]": 0, "hello": 1, "##ing": 2}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    texts = TokenTexts(wordpiece)
    for token_id in (1, 2):
        assert texts.text(token_id) == wordpiece.decode([token_id])
        assert texts.bytes(token_id) == list(texts.text(token_id).encode())


def test_id_past_the_vocabulary_is_empty(tokenizer):
    texts = TokenTexts(tokenizer)
    assert texts.text(len(tokenizer) + 7) == "" and texts.bytes(len(tokenizer) + 7) == []


class Ticker:
    """A coroutine that counts its turns on the event loop, and how many of them fell while
    the tokenizer was encoding in another thread."""

    def __init__(self) -> None:
        self.ticks = 0
        self.ticks_while_encoding = 0
        self.encoding = False
        self._stop = False

    async def run(self) -> None:
        while not self._stop:
            self.ticks += 1
            self.ticks_while_encoding += self.encoding
            await asyncio.sleep(0)

    def stop(self) -> None:
        self._stop = True


class WatchedTokenizer:
    """The real tokenizer, telling the ticker while encode() runs."""

    def __init__(self, tokenizer, ticker: Ticker) -> None:
        self._inner = tokenizer
        self._ticker = ticker

    def encode(self, *args, **kwargs):
        self._ticker.encoding = True
        try:
            return self._inner.encode(*args, **kwargs)
        finally:
            self._ticker.encoding = False

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


async def ticks_during(work, ticker: Ticker):
    """Run `work()` while the ticker runs; return its result and the ticks it let through."""
    task = asyncio.create_task(ticker.run())
    await asyncio.sleep(0)  # the ticker has started
    before = ticker.ticks
    try:
        result = await work()
    finally:
        ticker.stop()
        await task
    return result, ticker.ticks - before


async def test_long_prompt_is_tokenized_while_the_loop_keeps_ticking(tokenizer):
    ticker = Ticker()
    client = SimpleNamespace(tokenizer=WatchedTokenizer(tokenizer, ticker), vocab_size=49152)
    prompts, ticks = await ticks_during(lambda: tokenize_prompts(LONG_PROMPT, client), ticker)
    assert prompts == [tokenizer.encode(LONG_PROMPT)]
    assert ticks > 0 and ticker.ticks_while_encoding > 0


async def test_short_prompt_is_tokenized_inline(tokenizer):
    ticker = Ticker()
    client = SimpleNamespace(tokenizer=WatchedTokenizer(tokenizer, ticker), vocab_size=49152)
    prompt = "Hello there, " * 4
    assert len(prompt) <= INLINE_TOKENIZE_CHARS
    prompts, ticks = await ticks_during(lambda: tokenize_prompts(prompt, client), ticker)
    assert prompts == [tokenizer.encode(prompt)] and ticks == 0


async def test_long_chat_is_rendered_and_tokenized_while_the_loop_keeps_ticking(tokenizer):
    ticker = Ticker()
    client = SimpleNamespace(tokenizer=WatchedTokenizer(tokenizer, ticker))
    messages = [ChatMessage(role="user", content=LONG_PROMPT)]
    prompt, ticks = await ticks_during(lambda: apply_chat_template(client, messages), ticker)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": LONG_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == tokenizer.encode(text, add_special_tokens=False)
    assert ticks > 0 and ticker.ticks_while_encoding > 0


class BrokenTemplate:
    chat_template = "{{ raise_exception('roles must alternate') }}"

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("roles must alternate")


@pytest.mark.parametrize("content", ["hi", LONG_PROMPT])
async def test_template_errors_are_the_same_400_inline_or_off_loop(content):
    client = SimpleNamespace(tokenizer=BrokenTemplate())
    with pytest.raises(OpenAIError) as raised:
        await apply_chat_template(client, [ChatMessage(role="user", content=content)])
    assert raised.value.status == 400 and raised.value.param == "messages"
    assert "roles must alternate" in raised.value.message


@pytest.mark.parametrize("prompt", [[""], ["x" * 2_000, ""]])
async def test_empty_prompt_is_the_same_400_inline_or_off_loop(tokenizer, prompt):
    client = SimpleNamespace(tokenizer=tokenizer, vocab_size=49152)
    with pytest.raises(OpenAIError) as raised:
        await tokenize_prompts(prompt, client)
    assert raised.value.status == 400 and raised.value.param == "prompt"
