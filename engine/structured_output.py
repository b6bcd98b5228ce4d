"""Structured outputs with xgrammar: a request's StructuredOutput -> per-step token bitmasks.

grammar_of() turns the plain constraint (SamplingParams.structured_output) into an xgrammar
Grammar without the tokenizer; the HTTP layer calls it to answer a bad schema with a 400, the
engine to compile. StructuredOutputs, owned by the model runner, compiles each (kind, spec)
once and keeps one matcher per constrained request, keyed by request id.

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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from scheduler.output import ScheduledChunk
from scheduler.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

MAX_COMPILED_GRAMMARS = 256  # compiled grammars kept (LRU); each holds a per-token mask cache
# Whitespace inside JSON: compact separators, no free runs of spaces or newlines. A small
# model left free whitespace can spend its whole budget on it.
_JSON_SEPARATORS = (", ", ": ")


class StructuredOutputError(ValueError):
    """A constraint xgrammar cannot compile; the message names the problem."""


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


@dataclass(slots=True)
class _RequestMatcher:
    matcher: Any  # xgr.GrammarMatcher
    num_accepted: int = 0  # output tokens accepted, a prefix of the request's output
    broken: bool = False  # a token was refused (cannot happen when masks were applied)


class StructuredOutputs:
    """Owns xgrammar's view of the vocabulary (built on first use), the compiled grammars
    (LRU by constraint) and one matcher per constrained running request.

    Invariant: for every request id in `matchers`, the matcher has accepted exactly the first
    num_accepted tokens of that request's output, in order."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width), may exceed the tokenizer's
        self._compiler: Any = None
        self.compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self.matchers: dict[str, _RequestMatcher] = {}

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)

    def bitmask(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """[len(chunks), bitmask_width] int32, bit v of row i set when chunks[i] may sample
        token v (all bits set for unconstrained rows); None when no chunk is constrained."""
        rows = [i for i, c in enumerate(chunks) if c.sampling_params.structured_output]
        if not rows:
            return None
        bitmask = torch.full((len(chunks), self.bitmask_width), -1, dtype=torch.int32)
        for row in rows:
            state = self._caught_up(chunks[row])
            if not state.broken:
                state.matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def _caught_up(self, chunk: ScheduledChunk) -> _RequestMatcher:
        """The chunk's matcher, after accepting the output tokens it has not seen yet."""
        state = self.matchers.get(chunk.request_id)
        if state is None:
            grammar = self.compile(chunk.sampling_params.structured_output, chunk.eos_token_ids)
            state = self.matchers[chunk.request_id] = _RequestMatcher(xgr.GrammarMatcher(grammar))
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

    def compile(self, constraint: Any, eos_token_ids: frozenset[int] = frozenset()) -> Any:
        """The CompiledGrammar of a constraint, compiled once while it stays in the cache."""
        compiled = self.compiled.get(constraint)
        if compiled is not None:
            self.compiled.move_to_end(constraint)
            return compiled
        compiled = self._grammar_compiler(eos_token_ids).compile_grammar(grammar_of(constraint))
        self.compiled[constraint] = compiled
        if len(self.compiled) > MAX_COMPILED_GRAMMARS:
            self.compiled.popitem(last=False)
        return compiled

    def _grammar_compiler(self, eos_token_ids: frozenset[int]) -> Any:
        """Built on first use (xgrammar reads the whole vocabulary, ~0.2 s): the EOS ids are
        the engine's, the same for every request, and end a completed grammar."""
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(eos_token_ids) or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler
