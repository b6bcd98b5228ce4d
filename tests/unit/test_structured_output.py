"""Structured outputs: the bitmask application against its plain-torch reference, the sampler
with constrained rows against reference_sample, and the per-request matcher (catch-up after
preemption, no double advance, dropped on finish) with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from sampling_chunks import sampling_chunk
from transformers import AutoTokenizer

import engine.sampler as sampler_module
import engine.structured_output as structured_output_module
from engine.grammar_cache import GrammarCache
from engine.loader import hf_checkpoint_dir
from engine.sampler import sample_rows
from engine.sampling.logit_processors import needs_processing
from engine.sampling.reference import reference_sample, reference_token_bitmask
from engine.sampling.token_bitmask import apply_token_bitmask
from engine.structured_output import (
    COMPILE_THREAD_NAME,
    CompileQueueFull,
    StructuredOutputError,
    StructuredOutputs,
    grammar_of,
)
from scheduler.logit_bias import LogitBias
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput

VOCAB = 70  # not a multiple of 32: the last word is partly padding
WIDTH = (VOCAB + 31) // 32
EOS = 2
SCHEMA = StructuredOutput(
    "json_schema",
    json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
)


def _chunk(params: SamplingParams, request_id: str = "r", output: list[int] | None = None):
    return sampling_chunk(params, request_id, [1, 5], output, eos=EOS)


def _random_bitmask(rows: int, generator: torch.Generator) -> torch.Tensor:
    """int32 words of random bits (about half the tokens allowed), bit 31 (the sign) too."""
    words = torch.randint(-(2**31), 2**31, (rows, WIDTH), generator=generator, dtype=torch.int64)
    return words.to(torch.int32)


def test_the_reference_reads_xgrammars_bit_layout():
    bitmask = torch.zeros(WIDTH, dtype=torch.int32)
    bitmask[0] = 1 << 3  # token 3
    bitmask[1] = -(2**31)  # bit 31 of word 1: token 63
    bitmask[2] = 1 << 5  # token 69, the last real one
    masked = reference_token_bitmask(torch.zeros(VOCAB), bitmask)
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [3, 63, 69]


def test_apply_token_bitmask_matches_the_reference_on_its_rows_only():
    generator = torch.Generator().manual_seed(0)
    work = torch.randn(5, VOCAB, generator=generator)
    bitmask = _random_bitmask(5, generator)
    rows = [0, 3, 4]
    expected = work.clone()
    for r in rows:
        expected[r] = reference_token_bitmask(work[r], bitmask[r])
    apply_token_bitmask(work, bitmask, rows)
    assert torch.equal(work, expected)


def test_a_masked_greedy_row_keeps_the_logits_dtype_and_plain_rows_pay_nothing(monkeypatch):
    """A greedy constrained row needs no float32 copy: its bf16 row is masked and argmaxed.
    Without a bitmask (no constrained row in the step) nothing is copied at all."""
    constrained = SamplingParams(temperature=0.0, structured_output=SCHEMA)
    assert not needs_processing(_chunk(constrained))
    chunks = [_chunk(constrained, "c"), _chunk(SamplingParams(temperature=0.0), "p")]
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    bitmask = torch.full((2, WIDTH), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 1] = 1 << 2  # only token 34
    seen = []
    real = sampler_module.apply_token_bitmask
    monkeypatch.setattr(
        sampler_module, "apply_token_bitmask", lambda w, b, r: (seen.append(w.dtype), real(w, b, r))
    )
    token_ids, _ = sample_rows(logits, chunks, torch.zeros(2, dtype=torch.float64), bitmask=bitmask)
    assert token_ids == [34, int(logits[1].float().argmax())] and seen == [torch.bfloat16]
    sample_rows(logits, chunks[1:], torch.zeros(1, dtype=torch.float64))
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize("logprobs", [None, 3])
def test_sample_rows_with_a_bitmask_matches_reference_sample(logprobs):
    generator = torch.Generator().manual_seed(1)
    params = [
        SamplingParams(temperature=0.0, structured_output=SCHEMA, logprobs=logprobs),
        SamplingParams(temperature=0.0),  # plain greedy: the fast path, bitmask not read
        SamplingParams(temperature=0.8, top_p=0.9, structured_output=SCHEMA, logprobs=logprobs),
        SamplingParams(temperature=1.0, top_k=5),  # sampled, unconstrained
        SamplingParams(
            temperature=0.0, structured_output=SCHEMA, logit_bias=LogitBias.of(((7, 5.0),))
        ),
    ]
    chunks = [_chunk(p, f"r{i}") for i, p in enumerate(params)]
    for trial in range(20):
        logits = torch.randn(len(chunks), VOCAB, generator=generator).to(torch.bfloat16)
        bitmask = _random_bitmask(len(chunks), generator)
        uniforms = torch.rand(len(chunks), dtype=torch.float64, generator=generator)
        token_ids, entries = sample_rows(logits, chunks, uniforms, bitmask=bitmask)
        for row, chunk in enumerate(chunks):
            constrained = chunk.sampling_params.structured_output is not None
            expected, entry = reference_sample(
                logits[row], chunk, float(uniforms[row]), bitmask[row] if constrained else None
            )
            assert token_ids[row] == expected, (trial, row)
            if constrained:
                assert reference_token_bitmask(torch.zeros(VOCAB), bitmask[row])[expected] == 0
            if entry is not None:  # logprobs are the model's processed ones, before the mask
                assert entries[row].top_token_ids == entry.top_token_ids
                assert entries[row].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_structured_output_refuses_min_tokens_and_ignore_eos():
    for fields in ({"min_tokens": 2}, {"ignore_eos": True}):
        with pytest.raises(SamplingParamsError) as raised:
            SamplingParams(max_tokens=8, structured_output=SCHEMA, **fields)
        assert raised.value.param == next(iter(fields))
    with pytest.raises(SamplingParamsError):
        StructuredOutput("yaml", "")


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        (StructuredOutput("json_schema", '{"type": "bogus"}'), 'Unsupported type "bogus"'),
        (StructuredOutput("regex", "((("), "parenthesis"),
        (StructuredOutput("grammar", "root ::= foo"), 'Rule "foo" is not defined'),
        (StructuredOutput("choice", "[]"), "at least one"),
    ],
)
def test_a_constraint_that_does_not_compile_names_the_problem(constraint, problem):
    with pytest.raises(StructuredOutputError) as raised:
        grammar_of(constraint)
    assert problem in str(raised.value) and "json_schema_converter" not in str(raised.value)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(hf_checkpoint_dir("default"))


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    masked = reference_token_bitmask(torch.zeros(vocab), bitmask_row)
    return set(torch.isfinite(masked).nonzero().flatten().tolist())


def _greedy_walk(structured: StructuredOutputs, chunk_for, steps: int, eos: int) -> list[int]:
    """Pick the lowest allowed token each step, as a fake runner + scheduler would, until
    EOS (which finishes the request)."""
    output: list[int] = []
    while len(output) < steps and eos not in output:
        bitmask = structured.bitmask([chunk_for(output)])
        output.append(min(_allowed(bitmask[0], structured.vocab_size)))
    return output


def test_the_matcher_catches_up_after_preemption_without_double_advancing(tokenizer):
    vocab = len(tokenizer)
    constraint = StructuredOutput("choice", json.dumps(["yes", "no"]))
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_output=constraint)
    text = "yes"
    target = tokenizer.encode(text, add_special_tokens=False)
    structured = StructuredOutputs(tokenizer, vocab)

    def chunk(output: list[int], request_id: str = "a") -> ScheduledChunk:
        c = _chunk(params, request_id, list(output))
        c.eos_token_ids = frozenset({tokenizer.eos_token_id})
        return c

    first = structured.bitmask([chunk([])])[0]
    assert set(target[:1]) <= _allowed(first, vocab)
    # The same step seen twice (no token appended in between) does not advance the matcher.
    again = structured.bitmask([chunk([])])[0]
    assert torch.equal(first, again) and structured.matchers["a"].num_accepted == 0
    # Preempted after every token of "yes": the recompute chunk carries the whole output; the
    # matcher accepts the tail once and then allows only EOS.
    done = structured.bitmask([chunk(target)])[0]
    assert _allowed(done, vocab) == {tokenizer.eos_token_id}
    assert structured.matchers["a"].num_accepted == len(target)
    assert not structured.matchers["a"].broken
    again = structured.bitmask([chunk(target)])[0]  # recomputed again: nothing re-accepted
    assert torch.equal(done, again)
    # An unconstrained row beside it is all ones; a finished request's matcher is dropped.
    plain = _chunk(SamplingParams(temperature=0.0), "b")
    both = structured.bitmask([plain, chunk(target)])
    assert bool((both[0] == -1).all()) and "b" not in structured.matchers
    structured.forget(["a"])
    assert structured.matchers == {}
    assert structured.bitmask([plain]) is None


def test_draft_rows_are_masked_after_the_drafts_before_them_and_rolled_back(tokenizer):
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    constraint = StructuredOutput("choice", json.dumps(["yes please", "no"]))
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_output=constraint)
    structured = StructuredOutputs(tokenizer, vocab)
    target = tokenizer.encode("yes please", add_special_tokens=False)
    assert len(target) >= 2

    def rows(drafts: list[int]) -> list[ScheduledChunk]:
        # What draft_verification.sample_row_chunks makes of one decode with these drafts.
        made = []
        for j in range(len(drafts) + 1):
            c = _chunk(params, "a", drafts[:j])
            c.eos_token_ids = frozenset({eos})
            made.append(c)
        return made

    plain = [structured.bitmask([row])[0] for row in rows(target)[:1]]
    # Drafts = the whole answer and EOS: row j allows exactly what follows target[:j].
    drafted = structured.bitmask(rows([*target, eos]))
    assert _allowed(drafted[0], vocab) == _allowed(plain[0], vocab)
    for j, token in enumerate(target):
        assert token in _allowed(drafted[j], vocab)
    assert _allowed(drafted[len(target)], vocab) == {eos}
    # Nothing was accepted for good: the matcher is where the outputs leave it.
    assert structured.matchers["a"].num_accepted == 0
    assert torch.equal(structured.bitmask(rows([]))[0], drafted[0])
    # A draft the grammar refuses: its own row forbids it, the rows after keep every bit.
    bad = tokenizer.encode(" maybe", add_special_tokens=False)[0]
    refused = structured.bitmask(rows([target[0], bad, target[1]]))
    assert bad not in _allowed(refused[1], vocab)
    assert bool((refused[2] == -1).all()) and bool((refused[3] == -1).all())
    assert not structured.matchers["a"].broken and structured.matchers["a"].num_accepted == 0


def test_a_schema_compiles_once_and_a_walk_yields_valid_json(tokenizer):
    vocab = len(tokenizer)
    structured = StructuredOutputs(tokenizer, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_output=SCHEMA)
    eos = tokenizer.eos_token_id

    def chunk_for(request_id):
        def make(output):
            c = _chunk(params, request_id, list(output))
            c.eos_token_ids = frozenset({eos})
            return c

        return make

    output = _greedy_walk(structured, chunk_for("x"), 40, eos)
    assert output[-1] == eos
    assert json.loads(tokenizer.decode(output[:-1])) in ({"ok": True}, {"ok": False})
    _greedy_walk(structured, chunk_for("y"), 3, eos)
    assert structured.cache.keys() == [SCHEMA]


# ---- compiled grammars: the cache's bounds, compiling ahead on the worker -------------------


class _Sized:
    def __init__(self, memory_size_bytes: int) -> None:
        self.memory_size_bytes = memory_size_bytes


def test_the_grammar_cache_keeps_the_most_recent_entries_within_its_entry_bound():
    cache = GrammarCache(max_entries=3, max_bytes=10**9)
    grammars = {key: _Sized(10) for key in "abcd"}
    for key in "abc":
        cache.put(key, grammars[key])
        cache.check_invariants()
    assert cache.get("a") is grammars["a"]  # now the most recently used: b goes first
    cache.put("d", grammars["d"])
    cache.check_invariants()
    assert cache.keys() == ["c", "a", "d"] and cache.get("b") is None
    assert len(cache) == 3 and cache.num_bytes == 30


def test_the_grammar_cache_evicts_to_its_byte_bound_but_keeps_the_entry_put_last():
    cache = GrammarCache(max_entries=100, max_bytes=100)
    for key, size in (("a", 40), ("b", 40), ("c", 30)):
        cache.put(key, _Sized(size))
        cache.check_invariants()
    assert cache.keys() == ["b", "c"] and cache.num_bytes == 70
    cache.put("b", _Sized(50))  # replaced: its old size leaves the count
    cache.check_invariants()
    assert cache.keys() == ["c", "b"] and cache.num_bytes == 80
    cache.put("huge", _Sized(500))  # alone over the bound: kept, everything else evicted
    cache.check_invariants()
    assert cache.keys() == ["huge"] and cache.num_bytes == 500
    cache.put("e", _Sized(1))
    assert cache.keys() == ["e"] and cache.num_bytes == 1


def test_the_grammar_cache_stays_consistent_under_threads():
    cache = GrammarCache(max_entries=8, max_bytes=200)

    def work(thread: int) -> None:
        for i in range(500):
            key = (thread * 7 + i) % 13
            if cache.get(key) is None:
                cache.put(key, _Sized(1 + key * 3))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    cache.check_invariants()
    assert 0 < len(cache) <= 8


def _record_compiling_threads(monkeypatch) -> list[str]:
    """The names of the threads that compile (every compile starts with grammar_of)."""
    names: list[str] = []
    real = structured_output_module.grammar_of

    def recording(constraint):
        names.append(threading.current_thread().name)
        return real(constraint)

    monkeypatch.setattr(structured_output_module, "grammar_of", recording)
    return names


def test_compile_async_compiles_on_the_worker_what_the_step_then_finds(tokenizer, monkeypatch):
    structured = StructuredOutputs(tokenizer, len(tokenizer))
    threads = _record_compiling_threads(monkeypatch)
    ahead = structured.compile_async(SCHEMA).result(timeout=60)
    assert ahead.compile_seconds > 0 and threads == [f"{COMPILE_THREAD_NAME}_0"]
    assert structured.compile(SCHEMA) is ahead.grammar  # the in-step path: a cache hit
    again = structured.compile_async(SCHEMA)
    assert again.done() and again.result().grammar is ahead.grammar
    assert again.result().compile_seconds == 0.0
    params = SamplingParams(temperature=0.0, structured_output=SCHEMA)
    structured.bitmask([_chunk(params, "x")])
    assert threads == [f"{COMPILE_THREAD_NAME}_0"]  # nothing compiled on the engine thread


def test_a_request_not_compiled_ahead_compiles_in_the_step_and_says_so(
    tokenizer, monkeypatch, caplog
):
    structured = StructuredOutputs(tokenizer, len(tokenizer))
    threads = _record_compiling_threads(monkeypatch)
    params = SamplingParams(temperature=0.0, structured_output=SCHEMA)
    with caplog.at_level(logging.INFO, logger="engine.structured_output"):
        structured.bitmask([_chunk(params, "offline")])
    assert threads == [threading.current_thread().name]
    assert "request offline: grammar compiled inside the step" in caplog.text
    assert structured.compile_async(SCHEMA).result().grammar is structured.compile(SCHEMA)


def test_compile_async_from_many_threads_compiles_once(tokenizer):
    structured = StructuredOutputs(tokenizer, len(tokenizer))
    regex = StructuredOutput("regex", "[a-z]{3}-[0-9]{2}")
    with ThreadPoolExecutor(4) as pool:
        futures = list(pool.map(lambda _: structured.compile_async(regex), range(8)))
    results = [future.result(timeout=60) for future in futures]
    assert len({id(result.grammar) for result in results}) == 1
    assert sum(result.compile_seconds > 0 for result in results) == 1
    structured.cache.check_invariants()


def test_compile_async_reports_a_constraint_that_does_not_compile(tokenizer):
    structured = StructuredOutputs(tokenizer, len(tokenizer))
    future = structured.compile_async(StructuredOutput("grammar", "root ::= foo"))
    with pytest.raises(StructuredOutputError, match='Rule "foo" is not defined'):
        future.result(timeout=60)
    assert len(structured.cache) == 0


def test_every_eos_id_of_the_request_ends_a_completed_grammar(tokenizer):
    """Compiled grammars do not know the engine's EOS ids; each matcher gets its request's."""
    vocab = len(tokenizer)
    structured = StructuredOutputs(tokenizer, vocab)
    constraint = StructuredOutput("choice", json.dumps(["yes"]))
    params = SamplingParams(temperature=0.0, structured_output=constraint)
    target = tokenizer.encode("yes", add_special_tokens=False)
    chunk = _chunk(params, "two", target)
    chunk.eos_token_ids = frozenset({0, tokenizer.eos_token_id})
    assert _allowed(structured.bitmask([chunk])[0], vocab) == {0, tokenizer.eos_token_id}


def test_compiles_past_the_pending_bound_are_refused_until_one_is_done(tokenizer, monkeypatch):
    """MAX_PENDING_COMPILES queued or running: one more is CompileQueueFull (a 429 at the
    HTTP edge); once they finish, compiles are accepted again."""
    monkeypatch.setattr(structured_output_module, "MAX_PENDING_COMPILES", 2)
    structured = StructuredOutputs(tokenizer, len(tokenizer))
    release = threading.Event()
    compile_now = structured._compile
    monkeypatch.setattr(structured, "_compile", lambda c: release.wait(60) and compile_now(c))
    held = [structured.compile_async(StructuredOutput("regex", f"[a-z]{{{i}}}")) for i in (1, 2)]
    # Asking again for a grammar being compiled waits on that compile (no new place in the
    # line, and no second bill for its seconds).
    again = structured.compile_async(StructuredOutput("regex", "[a-z]{1}"))
    with pytest.raises(CompileQueueFull):
        structured.compile_async(StructuredOutput("regex", "[a-z]{3}"))
    release.set()
    assert all(future.result(timeout=60).compile_seconds > 0 for future in held)
    assert again.result(timeout=60).compile_seconds == 0.0
    assert again.result().grammar is held[0].result().grammar
    deadline = time.monotonic() + 60  # done callbacks run on the worker, after the results
    while structured._in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    later = structured.compile_async(StructuredOutput("regex", "[a-z]{3}"))
    assert later.result(timeout=60).grammar is not None
