"""Sampler: logits of the sampling rows -> one token id per row (+ optional logprobs).

Order of processing for a row: logit_bias -> min_tokens ban of EOS/stop ids -> repetition,
presence and frequency penalties -> (logprobs are taken here, before temperature) ->
structured-output bitmask (-inf for tokens the row's grammar forbids) -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> draw.

The batch is split by what its rows need, and each part is done for all its rows at once:
  plain greedy rows   argmax of the model's own logits (the native kernel on bf16); they never
                      pay for the float32 copy, whatever shares the batch;
  masked greedy rows  greedy rows with a structured output and nothing else to process: a
                      copy of just these rows in the logits' dtype, their bitmask applied
                      (sampling/token_bitmask.py), the native argmax (bf16 is exact);
  processed rows      one float32 copy of just these rows, processors scattered into it
                      (sampling/logit_processors.py), a constrained row's bitmask applied;
                      greedy ones take its argmax;
  sampled rows        temperature, softmax, truncation from the top candidates and an inverse
                      CDF draw (sampling/truncation.py); with the native kernels, the same
                      rules over candidates the kernel picks (sampling/native.py), and rows
                      that only sample read the model's logits in place, never copied.
sampling/reference.py is the plain per-row definition all of this is tested against.

Draws: each sampled row consumes one uniform per step. A request with a seed draws it from its
own torch.Generator, so its draws do not depend on what else shares the batch (its logits
can: the model's kernels round differently at different row counts, e.g. a bf16 or GGUF model's
1-4-row matvecs against its larger-batch tiles, so a seeded or greedy request's tokens can
change with its batch, unless the engine runs batch-invariant, engine/batch_invariance.py);
unseeded rows
share one generator, seeded from os.urandom unless Sampler(seed=...) is given.
"""

from __future__ import annotations

import os

import torch

from engine.sampling.logit_processors import (
    needs_processing,
    processed_logits,
    samples_only,
    token_logprobs,
)
from engine.sampling.native import choose_native, usable
from engine.sampling.token_bitmask import apply_token_bitmask
from engine.sampling.truncation import choose_from_logits, select_rows
from scheduler.output import ScheduledChunk, TokenLogprobs


class Sampler:
    """Owns the shared and per-request generators; forget() drops them when requests finish."""

    def __init__(self, seed: int | None = None, kernels=None) -> None:
        self.kernels = kernels  # native argmax for the greedy fast path, when built
        if seed is None:  # a fresh stream per process: restarts must not replay samples
            seed = int.from_bytes(os.urandom(8), "little")
        self.shared_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        chunks: list[ScheduledChunk],
        bitmask: torch.Tensor | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(chunks), vocab] (any float dtype), row i belongs to chunks[i];
        bitmask: [len(chunks), ceil(vocab / 32)] int32 allowed tokens, read for the rows
        with a structured_output (engine/structured_output.py builds it)."""
        return sample_rows(logits, chunks, self._uniforms(chunks), self.kernels, bitmask)

    def _uniforms(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """[len(chunks)] float64 in [0, 1): one draw per sampled row, 0 for greedy rows."""
        uniforms = torch.zeros(len(chunks), dtype=torch.float64)
        unseeded = []
        for row, chunk in enumerate(chunks):
            params = chunk.sampling_params
            if params.greedy:
                continue
            if params.seed is None:
                unseeded.append(row)
                continue
            generator = self.generators.get(chunk.request_id)
            if generator is None:
                generator = torch.Generator().manual_seed(params.seed)
                self.generators[chunk.request_id] = generator
            uniforms[row] = torch.rand((), dtype=torch.float64, generator=generator)
        if unseeded:
            draws = torch.rand(len(unseeded), dtype=torch.float64, generator=self.shared_generator)
            uniforms[unseeded] = draws
        return uniforms


def sample_rows(
    logits: torch.Tensor,
    chunks: list[ScheduledChunk],
    uniforms: torch.Tensor,
    kernels=None,
    bitmask: torch.Tensor | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sampler.sample with the draws given: uniforms[i] (float64 in [0, 1)) is row i's."""
    processed = [row for row, chunk in enumerate(chunks) if needs_processing(chunk)]
    masked = [] if bitmask is None else _masked_greedy_rows(chunks)
    if not processed and not masked:
        return greedy_token_ids(logits, kernels).tolist(), [None] * len(chunks)
    token_ids = torch.empty(len(chunks), dtype=torch.long)
    direct = _direct_rows(logits, chunks, processed, kernels)
    if direct:  # sampled straight from the model's logits: no float32 copy
        params = [chunks[row].sampling_params for row in direct]
        token_ids[direct] = choose_native(logits, direct, params, uniforms[direct], kernels)
        drawn = set(direct)
        processed = [row for row in processed if row not in drawn]
    plain = sorted(set(range(len(chunks))) - set(processed) - set(masked) - set(direct))
    if plain:
        token_ids[plain] = greedy_token_ids(select_rows(logits, plain), kernels)
    if masked:
        work = logits.index_select(0, torch.tensor(masked))  # a copy, in the logits' dtype
        apply_token_bitmask(work, bitmask[masked], list(range(len(masked))))
        token_ids[masked] = greedy_token_ids(work, kernels)
    if not processed:
        return token_ids.tolist(), [None] * len(chunks)
    sub = [chunks[row] for row in processed]
    work = processed_logits(logits, processed, sub)  # [P, V] float32, row j is processed[j]
    asking = [j for j, chunk in enumerate(sub) if chunk.sampling_params.logprobs is not None]
    logprobs = torch.log_softmax(select_rows(work, asking), dim=-1) if asking else None
    constrained = [j for j, chunk in enumerate(sub) if chunk.sampling_params.structured_output]
    if constrained and bitmask is not None:  # after logprobs: they show the model's choice
        apply_token_bitmask(work, bitmask[processed], constrained)
    token_ids[processed] = _choose(work, sub, uniforms[processed], kernels)  # may scale work
    result = token_ids.tolist()
    per_row: list[TokenLogprobs | None] = [None] * len(chunks)
    if logprobs is not None:
        rows = [processed[j] for j in asking]
        tops = [chunks[row].sampling_params.logprobs or 0 for row in rows]
        for row, entry in zip(rows, token_logprobs(logprobs, [result[r] for r in rows], tops)):
            per_row[row] = entry
    return result, per_row


def _direct_rows(
    logits: torch.Tensor, chunks: list[ScheduledChunk], processed: list[int], kernels
) -> list[int]:
    """Processed rows that only sample (no logprobs, penalties, bias, min_tokens ban or
    grammar), when the native kernels can read the logits as they are."""
    if not usable(logits, kernels):
        return []
    return [row for row in processed if samples_only(chunks[row])]


def _masked_greedy_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Greedy rows with a structured output and no other processing."""
    return [
        row
        for row, chunk in enumerate(chunks)
        if chunk.sampling_params.structured_output is not None and not needs_processing(chunk)
    ]


def _choose(
    work: torch.Tensor, chunks: list[ScheduledChunk], uniforms: torch.Tensor, kernels
) -> torch.Tensor:
    """Token ids [P] for processed logits work [P, V]: argmax, or a draw after temperature."""
    chosen = torch.empty(len(chunks), dtype=torch.long)
    greedy = [j for j, chunk in enumerate(chunks) if chunk.sampling_params.greedy]
    if greedy:
        chosen[greedy] = greedy_token_ids(select_rows(work, greedy), kernels)
    sampled = [j for j, chunk in enumerate(chunks) if not chunk.sampling_params.greedy]
    if sampled:
        params = [chunks[j].sampling_params for j in sampled]
        if usable(work, kernels):
            chosen[sampled] = choose_native(work, sampled, params, uniforms[sampled], kernels)
            return chosen
        # work itself when every row samples: scaled in place
        chosen[sampled] = choose_from_logits(select_rows(work, sampled), params, uniforms[sampled])
    return chosen


def greedy_token_ids(logits: torch.Tensor, kernels=None) -> torch.Tensor:
    """First maximum of each row ([rows] int64), on the logits' own dtype (bf16 is exact)."""
    if kernels is not None and logits.is_contiguous():
        return kernels.argmax_rows(logits)  # ~10x torch's bf16 max
    # max(...).indices: same first-maximum rule as argmax, measurably faster on CPU.
    return logits.max(dim=-1).indices
