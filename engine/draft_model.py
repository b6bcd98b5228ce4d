"""DraftModel: speculative decoding's drafts from a smaller model (method "draft_model").

The scheduler reserves each drafting decode's slots (scheduler/drafting.py, DRAFT_SLOT) and
allocates their KV blocks; before the target's pass, propose() fills them: the draft model
catches up on the request's tokens it has not seen, then proposes one token per pass, greedily,
every drafting request in the same passes. The target verifies them as it verifies n-gram drafts
(engine/draft_verification.py): drafts proposed without looking at the target's draws leave
every emitted token's distribution that of plain decoding, so what the draft model proposes
only ever changes how many drafts are accepted, never the output.

The draft model's KV cache shares the target's block tables: a block id holds the target's K/V
in the target's tensors and the draft's in the draft's, so the scheduler's allocation,
preemption and freeing cover both, and a prefix-cache hit brings the draft's K/V with the
target's. Every step's first draft pass writes the positions the target computes in that step,
so the draft K/V of computed positions is the draft's own for the true tokens; what a decode's
draft passes wrote is remembered (tokens and block table), and the next step rewrites from the
first position where a rejected draft, or the last draft (on which no pass ran), left it stale.
If a draft pass fails, positions go unwritten: later drafts over them are worse, never wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.loader import LoadedCheckpoint, ModelLoadError, load_checkpoint
from engine.meter.cost_model import ChunkWork, CostModel, ModelShape
from engine.model_runner import ModelRunner
from engine.sliding_windows import layer_windows
from scheduler.output import ScheduledChunk, SchedulerOutput
from scheduler.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Written:
    """What one request's draft K/V holds, in block_table: its true tokens at positions below
    `known` (a request's tokens never change once known), then `drafts` from there on."""

    known: int
    drafts: list[int]
    block_table: list[int]

    def reusable(self, chunk: ScheduledChunk, block_size: int) -> int:
        """Leading positions still valid for the request as the chunk sees it: the known ones
        and the drafts it kept, within the blocks it still holds. Compares the drafts and the
        block tables only, not the whole context."""
        end = self.known + len(self.drafts)
        kept = _common_prefix(self.drafts, _known_tokens(chunk, self.known, end))
        blocks = self.block_table
        same = len(blocks) if chunk.block_table[: len(blocks)] == blocks else None
        if same is None:  # preempted since: blocks were freed and taken again
            same = _common_prefix(blocks, chunk.block_table)
        return min(self.known + kept, same * block_size)


@dataclass(slots=True)
class DraftCost:
    """FLOPs and bytes of one step's draft passes, per drafting request."""

    flops: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    num_passes: int = 0
    seconds: float = 0.0  # spent proposing, the failed passes' included


class DraftModel:
    """A second model runner over the target's block tables; propose() fills a step's slots."""

    def __init__(
        self,
        config: EngineConfig,
        spec: SpeculativeConfig,
        target: LoadedCheckpoint,
        max_model_len: int,
    ) -> None:
        checkpoint = load_checkpoint(spec.model)
        _check_compatible(checkpoint, target, max_model_len, spec.model)
        # The fault-injection tokens stay with the target, whose failures the engine isolates;
        # --quantization and int8 GGUF inputs are the target's choices (int8 inputs only where
        # the draft is a GGUF file too).
        gguf_activations = config.gguf_activations if checkpoint.gguf_path is not None else "exact"
        draft_config = dataclasses.replace(
            config,
            model=spec.model,
            quantization="none",
            gguf_activations=gguf_activations,
            speculative=None,
            debug_fault_token_id=None,
            debug_hang_token_id=None,
            debug_crash_token_id=None,
        )
        self.runner = ModelRunner(draft_config, checkpoint, max_model_len)
        self.shape = ModelShape.from_hf_config(
            checkpoint.config, self.runner.dtype_bytes, self.runner.num_params
        )
        self.block_size = config.block_size
        self.name = checkpoint.name
        self.cost_model: CostModel | None = None  # once the KV cache (and decode stack) exist
        self._written: dict[str, _Written] = {}

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.cost_model = CostModel(self.shape, self.runner.weight_bytes())

    def forget(self, finished_request_ids: list[str]) -> None:
        """Drop what is kept for requests that finished: what their K/V holds, their grammar
        matchers and seeded generators (the draft runner's passes carry no finished ids)."""
        for request_id in finished_request_ids:
            self._written.pop(request_id, None)
        self.runner.structured.forget(finished_request_ids)
        self.runner.sampler.forget(finished_request_ids)

    def propose(self, chunks: list[ScheduledChunk]) -> DraftCost:
        """Fill the drafting decodes' slots in place (token_ids and draft_token_ids). The first
        pass also writes every other chunk's new tokens into the draft K/V, so a decode's
        catch-up is its last token, and prefills stay within the step's token budget. A decode
        drafts nothing past an end token it drafted (the slots after it are dropped). If a
        draft pass fails, this step's decodes go without drafts (logged), and nothing else
        changes."""
        cost = DraftCost()
        started = time.monotonic()
        try:
            proposed = self._run_passes(chunks, cost)
        except Exception:
            log.exception("draft model pass failed; this step's decodes verify no drafts")
            ids = [chunk.request_id for chunk in chunks]
            self.runner.structured.forget(ids)  # they may hold drafts as outputs
            for chunk in chunks:
                self._written.pop(chunk.request_id, None)
                _fill(chunk, [])
            cost.seconds = time.monotonic() - started
            return cost
        for chunk in chunks:
            if chunk.draft_token_ids:
                drafts = proposed[chunk.request_id]
                # Its matcher took each draft but the last as an output to mask the next.
                self.runner.structured.rollback(chunk.request_id, len(drafts) - 1)
                _fill(chunk, drafts)
            self._remember(chunk)
        cost.seconds = time.monotonic() - started
        return cost

    def _run_passes(self, chunks: list[ScheduledChunk], cost: DraftCost) -> dict[str, list[int]]:
        """Draft pass 1 over every chunk's unwritten tokens, then one pass per further draft.
        Each pass samples as the request's own greedy row would (its penalties, logit bias,
        min_tokens and grammar, with the drafts before it as outputs), so a draft the target
        would mask out is never proposed."""
        slots = {c.request_id: len(c.draft_token_ids) for c in chunks if c.draft_token_ids}
        proposed: dict[str, list[int]] = {rid: [] for rid in slots}
        passes = [p for p in (self._catch_up(c) for c in chunks) if p.token_ids]
        while passes:
            sampled = self.runner.execute(SchedulerOutput(chunks=passes)).sampled_token_ids
            self._charge(passes, cost)
            following = []
            for chunk in passes:
                if not chunk.samples:
                    continue
                drafts = proposed[chunk.request_id]
                drafts.append(sampled[chunk.request_id])
                if len(drafts) < slots[chunk.request_id] and not _ends(chunk, drafts[-1]):
                    outputs = chunk.output_token_ids + drafts[-1:]
                    following.append(
                        _draft_chunk(chunk, [drafts[-1]], chunk.context_len, outputs=outputs)
                    )
            passes = following
        return proposed

    def _catch_up(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """A chunk's first draft pass: the known tokens through this chunk that the draft K/V
        lacks; a drafting decode's pass samples at its last known token (its first draft).

        A prefill chunk's earlier positions were written by the draft in the steps that
        computed them, or are prefix-cache hits, written when their blocks were computed: the
        pass mirrors the target's chunk, within the step's token budget. A decode's are what
        the draft last wrote for it, up to the first draft the target rejected (its last draft
        was never run)."""
        end = chunk.context_len - chunk.num_draft_tokens
        drafting = bool(chunk.draft_token_ids)
        if chunk.is_decode:
            written = self._written.get(chunk.request_id)
            start = 0 if written is None else written.reusable(chunk, self.block_size)
        else:
            start = chunk.start_position
        if drafting:  # the last known token's logits propose the first draft
            start = min(start, end - 1)
        return _draft_chunk(chunk, _known_tokens(chunk, start, end), start, samples=drafting)

    def _remember(self, chunk: ScheduledChunk) -> None:
        """The chunk's known tokens, then every draft but the last (no pass ran on it)."""
        end = chunk.context_len - chunk.num_draft_tokens
        self._written[chunk.request_id] = _Written(
            end, chunk.draft_token_ids[:-1], list(chunk.block_table)
        )

    def _charge(self, passes: list[ScheduledChunk], cost: DraftCost) -> None:
        assert self.cost_model is not None
        works = [
            ChunkWork(len(c.token_ids), c.context_len, c.samples, len(c.token_ids) == 1)
            for c in passes
        ]
        step = self.cost_model.step_cost(works)
        for chunk, flops, nbytes in zip(passes, step.chunk_flops, step.chunk_bytes, strict=True):
            rid = chunk.request_id
            cost.flops[rid] = cost.flops.get(rid, 0.0) + flops
            cost.bytes[rid] = cost.bytes.get(rid, 0.0) + nbytes
        cost.num_passes += 1


NO_DRAFT_COST = DraftCost()


def _fill(chunk: ScheduledChunk, drafts: list[int]) -> None:
    """The chunk's slots replaced by the drafts proposed (as many or fewer: the KV slots left
    over stay allocated to the request, as unused draft slots always do)."""
    num_slots = len(chunk.draft_token_ids)
    if num_slots:
        del chunk.token_ids[-num_slots:]
    chunk.token_ids.extend(drafts)
    chunk.draft_token_ids[:] = drafts


def _ends(chunk: ScheduledChunk, token_id: int) -> bool:
    """Whether the token ends the request: nothing after it is worth drafting."""
    params = chunk.sampling_params
    eos = token_id in chunk.eos_token_ids and not params.ignore_eos
    return eos or token_id in params.stop_token_ids


def _draft_chunk(
    chunk: ScheduledChunk,
    token_ids: list[int],
    start: int,
    samples: bool = True,
    outputs: list[int] | None = None,
) -> ScheduledChunk:
    """A greedy pass of the draft model over token_ids at positions start.. of the request,
    sampling as the request's greedy row would, `outputs` its outputs so far."""
    params = chunk.sampling_params
    greedy = dataclasses.replace(
        params,
        temperature=0.0,
        seed=None,
        logprobs=None,
        prompt_logprobs=None,
        report_progress=False,
    )
    return ScheduledChunk(
        request_id=chunk.request_id,
        token_ids=token_ids,
        start_position=start,
        block_table=chunk.block_table,
        samples=samples,
        num_prompt_tokens=chunk.num_prompt_tokens,
        sampling_params=greedy,
        prompt_token_ids=chunk.prompt_token_ids,
        output_token_ids=chunk.output_token_ids if outputs is None else outputs,
        eos_token_ids=chunk.eos_token_ids,
    )


def _known_tokens(chunk: ScheduledChunk, start: int, end: int) -> list[int]:
    """The request's tokens at positions [start, end), without joining its whole context."""
    prompt, outputs = chunk.prompt_token_ids, chunk.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + outputs[max(start - n, 0) : end - n]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_compatible(
    draft: LoadedCheckpoint, target: LoadedCheckpoint, max_model_len: int, path: str
) -> None:
    """A draft model must speak the target's token ids, see the whole context, and attend to
    all of it (the shared block tables lose what a sliding window frees)."""
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ModelLoadError(
            f"draft model {path} has a different vocabulary from the target: a draft model must "
            "share the target's tokenizer"
        )
    limit = getattr(draft.config, "max_position_embeddings", None) or 2048
    if limit < max_model_len:
        raise ModelLoadError(
            f"draft model {path} handles {limit} positions, less than the context "
            f"({max_model_len}): pass --max-model-len {limit} or less"
        )
    for name, checkpoint in (("draft model", draft), ("target model", target)):
        if any(window is not None for window in layer_windows(checkpoint.config)):
            raise ModelLoadError(
                f"speculation with a draft model is not served with sliding-window attention "
                f"(the {name} has it)"
            )
