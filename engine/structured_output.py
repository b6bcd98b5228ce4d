"""Structured outputs with xgrammar: a request's StructuredOutput -> per-step token bitmasks.

grammar_of() turns the plain constraint (SamplingParams.structured_output) into an xgrammar
Grammar without the tokenizer. StructuredOutputs, owned by the model runner, compiles each
(kind, spec) once into a GrammarCache (engine/grammar_cache.py) and keeps one matcher per
constrained request, keyed by request id.

Compiling is never the batch's cost: the HTTP layer calls compile_async() before it submits
a request, which runs grammar_of + compile on one worker thread (xgrammar releases the GIL
while it compiles), so neither the event loop nor the engine thread waits; the request then
finds its grammar cached when its first row is masked. Only a request that was not compiled
ahead (offline LLM.generate, or an entry evicted in between) compiles inside the step, and
that is logged. A compiled grammar does not depend on the engine's EOS ids: each matcher is
given its request's (override_stop_tokens), so compile_async needs nothing but the constraint.

No double advance, and catch-up after preemption: a matcher counts the output tokens it has
accepted. Before its row is masked it accepts output_token_ids[num_accepted:], the tokens
the scheduler appended since (one per decode step; none on a recompute that re-reads tokens
already accepted; the tail when a preempted request resumes). A token the runner sampled but
the scheduler did not append is never accepted. forget() drops a finished request's matcher.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.grammar_cache import GrammarCache
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

# Compiled grammars kept (LRU), bounded both ways: a small schema compiles to ~60 KB, but a
# 400-property schema with a regex pattern each to ~20 MB (its per-token mask cache).
MAX_COMPILED_GRAMMARS = 256
MAX_COMPILED_GRAMMAR_BYTES = 256 * 2**20
# xgrammar's own cache (grammars and the sub-rule masks they share, which make a schema that
# repeats another's patterns compile faster), bounded too; it holds some of the same objects.
XGRAMMAR_CACHE_LIMIT_BYTES = 256 * 2**20
COMPILE_THREAD_NAME = "grammar-compile"  # the one worker thread of compile_async
# Distinct compiles queued or running at once; one more is refused (CompileQueueFull), so a
# flood of distinct schemas costs its sender retries, not everyone memory and a longer line.
MAX_PENDING_COMPILES = 16
# Whitespace inside JSON: compact separators, no free runs of spaces or newlines. A small
# model left free whitespace can spend its whole budget on it.
_JSON_SEPARATORS = (", ", ": ")


class StructuredOutputError(ValueError):
    """A constraint xgrammar cannot compile; the message names the problem."""


class CompileQueueFull(RuntimeError):
    """MAX_PENDING_COMPILES compiles are already queued or running."""


def grammar_of(constraint: StructuredOutput) -> Any:
    """The xgrammar Grammar of a constraint; StructuredOutputError when it does not compile."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=_JSON_SEPARATORS
            )
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(
                spec, any_whitespace=False, separators=_JSON_SEPARATORS
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
    except RuntimeError as exc:  # xgrammar's parse errors: "[time] file.cc:line: message"
        raise StructuredOutputError(_clean(str(exc))) from None
    raise StructuredOutputError(f"unknown structured output kind {kind!r}")


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" | ...; a JSON string literal is a valid EBNF string literal."""
    if not choices:
        raise StructuredOutputError("choice needs at least one string")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _clean(message: str) -> str:
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message.strip())


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    grammar: Any  # xgr.CompiledGrammar
    compile_seconds: float  # wall time this call spent compiling it; 0.0 on a cache hit


@dataclass(slots=True)
class _RequestMatcher:
    matcher: Any  # xgr.GrammarMatcher
    num_accepted: int = 0  # output tokens accepted, a prefix of the request's output
    broken: bool = False  # a token was refused (cannot happen when masks were applied)


def _without_seconds(running: Future[CompiledConstraint]) -> Future[CompiledConstraint]:
    """A future of the same compile for a request that did not start it: 0 seconds billed."""
    shared: Future[CompiledConstraint] = Future()

    def copy(done: Future[CompiledConstraint]) -> None:
        if done.cancelled():
            shared.cancel()
        elif done.exception() is not None:
            shared.set_exception(done.exception())
        else:
            shared.set_result(CompiledConstraint(done.result().grammar, 0.0))

    running.add_done_callback(copy)
    return shared


class StructuredOutputs:
    """Owns xgrammar's view of the vocabulary (built on first use), the compile worker, the
    compiled grammars (a GrammarCache) and one matcher per constrained running request.

    Threads: compile_async() may be called from any thread; the cache and the compiler are
    shared with the worker; bitmask(), forget() and the matchers are the engine thread's.

    Invariant: for every request id in `matchers`, the matcher has accepted exactly the first
    num_accepted tokens of that request's output, in order."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width), may exceed the tokenizer's
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self.cache = GrammarCache(MAX_COMPILED_GRAMMARS, MAX_COMPILED_GRAMMAR_BYTES)
        # One thread: compiles queue behind each other instead of taking the engine's cores.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=COMPILE_THREAD_NAME)
        # Compiles queued or running, by constraint (under the lock): a second request for
        # the same grammar waits on the first's compile instead of queueing its own.
        self._in_flight: dict[StructuredOutput, Future[CompiledConstraint]] = {}
        self._pending_lock = threading.Lock()
        self.matchers: dict[str, _RequestMatcher] = {}

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Take back the last num_tokens outputs a request's matcher accepted: a draft model's
        own drafts, fed to its passes as outputs to mask the next one (engine/draft_model.py),
        are not outputs until the target keeps them."""
        state = self.matchers.get(request_id)
        if state is None or num_tokens <= 0:
            return
        if not state.broken:
            state.matcher.rollback(num_tokens)
        state.num_accepted -= num_tokens

    def bitmask(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """[len(chunks), bitmask_width] int32, bit v of row i set when chunks[i] may sample
        token v (all bits set for unconstrained rows); None when no chunk is constrained.

        A request verifying drafts has one row per draft position (engine/draft_verification:
        consecutive rows, each with the drafts before it appended to its outputs). Its matcher
        catches up on the first row's outputs only, then accepts each draft to mask the next
        row and rolls them all back: a draft is not an output until the scheduler appends it.
        Past a draft the grammar refuses, rows keep every bit: the refused draft cannot be
        sampled at its row, so verification stops there and the later rows are never used."""
        rows = [i for i, c in enumerate(chunks) if c.sampling_params.structured_output]
        if not rows:
            return None
        bitmask = torch.full((len(chunks), self.bitmask_width), -1, dtype=torch.int32)
        first = 0
        while first < len(rows):
            last = first  # rows[first..last]: one request's consecutive rows
            while last + 1 < len(rows) and _same_request(chunks, rows[last], rows[last + 1]):
                last += 1
            self._fill_rows(bitmask, chunks, rows[first : last + 1])
            first = last + 1
        return bitmask

    def _fill_rows(self, bitmask: torch.Tensor, chunks: list[ScheduledChunk], rows: list[int]):
        state = self._caught_up(chunks[rows[0]])
        if state.broken:
            return
        outputs = len(chunks[rows[0]].output_token_ids)
        drafted = 0  # drafts the matcher accepted for masking, rolled back below
        for row in rows:
            if state.matcher.is_terminated():  # a drafted stop token ended the grammar
                break
            state.matcher.fill_next_token_bitmask(bitmask, row)
            if row == rows[-1]:
                break
            draft = chunks[row + 1].output_token_ids[outputs + drafted]
            if not state.matcher.accept_token(draft):
                break
            drafted += 1
        if drafted:
            state.matcher.rollback(drafted)

    def _caught_up(self, chunk: ScheduledChunk) -> _RequestMatcher:
        """The chunk's matcher, after accepting the output tokens it has not seen yet."""
        state = self.matchers.get(chunk.request_id)
        if state is None:
            grammar = self._grammar_in_step(chunk)
            stop = sorted(chunk.eos_token_ids) or None  # None: the tokenizer's EOS
            matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stop)
            state = self.matchers[chunk.request_id] = _RequestMatcher(matcher)
        pending = chunk.output_token_ids[state.num_accepted :]
        for token_id in pending:
            if not state.broken and not state.matcher.accept_token(token_id):
                log.error(
                    "request %s: the grammar refused token %d; its output is unconstrained "
                    "from here",
                    chunk.request_id,
                    token_id,
                )
                state.broken = True
        state.num_accepted += len(pending)
        return state

    def _grammar_in_step(self, chunk: ScheduledChunk) -> Any:
        """A cache hit when the request was compiled ahead; else compiled here, in the step."""
        compiled = self._compile(chunk.sampling_params.structured_output)
        if compiled.compile_seconds:
            log.info(
                "request %s: grammar compiled inside the step in %.3f s (not compiled ahead)",
                chunk.request_id,
                compiled.compile_seconds,
            )
        return compiled.grammar

    def compile(self, constraint: StructuredOutput) -> Any:
        """The CompiledGrammar of a constraint, compiled on this thread unless cached."""
        return self._compile(constraint).grammar

    def compile_async(self, constraint: StructuredOutput) -> Future[CompiledConstraint]:
        """The constraint compiled on the worker thread (a done future on a cache hit); the
        future raises StructuredOutputError when it does not compile. Thread-safe. Callers
        asking for a constraint already being compiled wait on that compile (so do not cancel
        a future: wait with a timeout instead) and get compile_seconds 0: the seconds are
        billed once, to the request that started it. CompileQueueFull past
        MAX_PENDING_COMPILES distinct compiles."""
        cached = self.cache.get(constraint)
        if cached is not None:
            future: Future[CompiledConstraint] = Future()
            future.set_result(CompiledConstraint(cached, 0.0))
            return future
        with self._pending_lock:
            running = self._in_flight.get(constraint)
            if running is not None:
                return _without_seconds(running)
            if len(self._in_flight) >= MAX_PENDING_COMPILES:
                raise CompileQueueFull(
                    f"{MAX_PENDING_COMPILES} grammars are already being compiled; retry shortly"
                )
            future = self._worker.submit(self._compile, constraint)
            self._in_flight[constraint] = future
        future.add_done_callback(lambda _: self._compile_done(constraint))
        return future

    def _compile_done(self, constraint: StructuredOutput) -> None:  # on the worker
        with self._pending_lock:
            self._in_flight.pop(constraint, None)

    def _compile(self, constraint: StructuredOutput) -> CompiledConstraint:
        cached = self.cache.get(constraint)  # again: a compile queued before may have put it
        if cached is not None:
            return CompiledConstraint(cached, 0.0)
        compiler = self._grammar_compiler()  # its one-time build is nobody's compile time
        start = time.perf_counter()
        grammar = grammar_of(constraint)
        try:
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise StructuredOutputError(_clean(str(exc))) from None
        seconds = time.perf_counter() - start
        self.cache.put(constraint, compiled)
        return CompiledConstraint(compiled, seconds)

    def _grammar_compiler(self) -> Any:
        """Built on first use (xgrammar reads the whole vocabulary, ~0.2 s), by whichever
        thread compiles first."""
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=XGRAMMAR_CACHE_LIMIT_BYTES
                )
            return self._compiler


def _same_request(chunks: list[ScheduledChunk], row: int, next_row: int) -> bool:
    """Rows `row` and `next_row` are consecutive draft positions of one request."""
    return next_row == row + 1 and chunks[next_row].request_id == chunks[row].request_id
