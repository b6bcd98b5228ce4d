"""EngineCore: one step = schedule -> execute -> update, plus the step's meter readings.

The meter (engine/meter) turns each executed step into FLOPs, bytes and attributed seconds;
_charge() books them on the step's requests.

Single-threaded by contract: every method is called from the one thread that owns the engine
(the server's engine thread, or LLM.generate's caller).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.draft_model import NO_DRAFT_COST, DraftCost, DraftModel
from engine.freed_memory import keep_freed_memory
from engine.kv_budget import choose_num_blocks, request_token_capacity
from engine.loader import load_checkpoint
from engine.meter.config import MeterConfig
from engine.meter.cost_model import ChunkWork, CostModel, ModelShape
from engine.meter.meter import NO_CHARGE, Meter, StepCharge
from engine.meter.peaks import resolve_peaks
from engine.model_runner import ModelRunner
from engine.sliding_windows import layer_windows, uniform_window
from engine.stats import KVCacheInfo, StepStats
from engine.thread_governor import governor_for
from kvcache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.output import RunnerOutput, SchedulerOutput, TokenEvent
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    events: list[TokenEvent] = field(default_factory=list)
    stats: StepStats | None = None  # None when nothing was scheduled


@dataclass(slots=True)
class ExecuteResult:
    runner_output: RunnerOutput
    failed: dict[str, str]  # request_id -> error message
    num_forward_passes: int
    expert_bytes_run: int = 0  # bytes of the experts run, over the passes (MoE)


class EngineCore:
    """Owns the scheduler, the KV cache manager, the model runner and the meter."""

    def __init__(self, config: EngineConfig, meter_config: MeterConfig | None = None) -> None:
        checkpoint = load_checkpoint(config.model)
        self.config = config
        self.tokenizer = checkpoint.tokenizer
        self.model_name = checkpoint.name
        self.max_model_len = _max_model_len(checkpoint.config, config.max_model_len)
        self.eos_token_ids = _eos_token_ids(
            checkpoint.config, checkpoint.tokenizer, checkpoint.generation_config
        )
        self.runner = ModelRunner(config, checkpoint, self.max_model_len)
        spec = config.speculative
        self.draft_model = (
            DraftModel(config, spec, checkpoint, self.max_model_len)
            if spec is not None and spec.method == "draft_model"
            else None
        )
        # A window shared by every layer lets the KV cache free what no query sees any more,
        # behind a reserved null block (kvcache/window.py).
        self.sliding_window = uniform_window(layer_windows(checkpoint.config))
        num_reserved = 0 if self.sliding_window is None else 1
        bytes_per_block = self.runner.kv_bytes_per_block()
        if self.draft_model is not None:  # the draft's K/V lives in the same block ids
            bytes_per_block += self.draft_model.kv_bytes_per_block()
        num_blocks = choose_num_blocks(config, bytes_per_block, num_reserved)
        self.kv_cache_info = KVCacheInfo(
            config.block_size, num_blocks, bytes_per_block, num_reserved
        )
        self.runner.allocate_kv_cache(num_blocks)
        if self.draft_model is not None:
            self.draft_model.allocate_kv_cache(num_blocks)
        if config.keep_freed_memory:  # after loading, so what loading freed is not kept
            keep_freed_memory()
        self.kv_cache = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, self.sliding_window
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            long_prefill_token_threshold=_long_prefill_threshold(config),
            speculative=config.speculative,
            draft_step_rows=self.runner.draft_step_rows(),
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache)
        # Prompt + output tokens the KV cache holds for one request (None: unbounded under
        # the window), and what one request may use: that within the context.
        self.kv_tokens_per_request = request_token_capacity(
            self.kv_cache.num_usable_blocks,
            config.block_size,
            self.sliding_window,
            scheduler_config.max_request_step_tokens,
        )
        capacity = self.kv_tokens_per_request
        self.max_request_tokens = (
            self.max_model_len if capacity is None else min(self.max_model_len, capacity)
        )
        self.model_shape = ModelShape.from_hf_config(
            checkpoint.config, self.runner.dtype_bytes, self.runner.num_params
        )
        meter_config = meter_config if meter_config is not None else MeterConfig()
        self.meter = Meter(
            meter_config,
            CostModel(self.model_shape, self.runner.weight_bytes(), self.runner.batch_invariant),
            resolve_peaks(
                meter_config.peak_flops, meter_config.peak_memory_bandwidth, self.runner.dtype
            ),
        )
        self.max_running_batch_observed = 0
        self._draft_backoffs_seen = 0  # scheduler.num_draft_backoffs_total at the last step
        self.thread_governor = governor_for(config.num_threads)
        log.info(
            "engine ready: model %s, dtype %s, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d",
            self.model_name,
            str(self.runner.dtype).removeprefix("torch."),
            num_blocks,
            config.block_size,
            self.kv_cache_info.num_bytes / 2**20,
            self.max_model_len,
        )
        if self.draft_model is not None:
            log.info(
                "speculative drafts from %s, up to %d a decode",
                self.draft_model.name,
                config.speculative.num_speculative_tokens,
            )

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str = "",
        tenant: str = "",
    ) -> None:
        """Queue a request. Raises ValueError when it can never fit (the caller checks first).
        Only requests with the same `cache_salt` share prefix-cache blocks; admission takes
        turns between tenants."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the context is {self.max_model_len}"
            )
        capacity = self.kv_tokens_per_request
        if capacity is not None and total > capacity:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"KV cache ({capacity} tokens)"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            tenant=tenant,
        )
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str, error: str | None = None) -> TokenEvent | None:
        status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
        return self.scheduler.abort_request(request_id, status, error)

    def stop_request(self, request_id: str) -> TokenEvent | None:
        """Finish a request as stopped: a stop string matched in its detokenized text."""
        return self.scheduler.abort_request(request_id, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    # -- the step -----------------------------------------------------------------------
    def step(self) -> StepResult:
        if self.thread_governor is not None:  # fewer threads while neighbours hold cores
            self.thread_governor.adjust()
        started = time.monotonic()
        output = self.scheduler.schedule()
        drafted = self._draft(output)
        if output.is_empty:
            # Requests failed inside schedule() hand their final events over through update(),
            # and prefix lookups / preemptions made while scheduling nothing still count.
            events = self.scheduler.update(output, RunnerOutput())
            counted = output.prefix_cache_queried_tokens or output.num_preemptions
            stats = self._stats(output, NO_CHARGE, started, 0.0, _NO_EXECUTION) if counted else None
            return StepResult(events, stats)
        executed = self._execute(output)
        duration = time.monotonic() - started
        charge = self._charge(output, duration, executed.expert_bytes_run, drafted)
        events: list[TokenEvent] = []
        for request_id, error in executed.failed.items():
            events.extend(self.scheduler.fail_requests([request_id], error))
        events.extend(self.scheduler.update(output, executed.runner_output))
        self.max_running_batch_observed = max(self.max_running_batch_observed, len(output.chunks))
        stats = self._stats(output, charge, started, duration, executed, drafted)
        return StepResult(events, stats)

    def _draft(self, output: SchedulerOutput) -> DraftCost:
        """With a draft model: its passes fill the step's draft slots (engine/draft_model.py)."""
        if self.draft_model is None:
            return NO_DRAFT_COST
        self.draft_model.forget(output.finished_request_ids)
        return self.draft_model.propose(output.chunks)

    def _execute(self, output: SchedulerOutput) -> ExecuteResult:
        """Run the step; if it raises, re-run chunk by chunk so only the culprits fail."""
        try:
            runner_output = self.runner.execute(output)
            return ExecuteResult(runner_output, {}, 1, self.runner.expert_bytes_run)
        except Exception as exc:
            log.exception("model step failed; isolating the failing requests")
            if len(output.chunks) == 1:
                return ExecuteResult(RunnerOutput(), {output.chunks[0].request_id: _why(exc)}, 1)
        merged, failed, expert_bytes_run = RunnerOutput(), {}, 0
        for chunk in output.chunks:
            try:
                single = self.runner.execute(SchedulerOutput(chunks=[chunk]))
            except Exception as exc:  # noqa: BLE001
                failed[chunk.request_id] = _why(exc)
                continue
            merged.sampled_token_ids.update(single.sampled_token_ids)
            merged.logprobs.update(single.logprobs)
            merged.prompt_logprobs.update(single.prompt_logprobs)
            merged.accepted_draft_token_ids.update(single.accepted_draft_token_ids)
            merged.accepted_logprobs.update(single.accepted_logprobs)
            expert_bytes_run += self.runner.expert_bytes_run
        return ExecuteResult(merged, failed, 1 + len(output.chunks), expert_bytes_run)

    def _charge(
        self, output: SchedulerOutput, duration: float, expert_bytes_run: int, drafted: DraftCost
    ) -> StepCharge:
        """Meter the step and book each chunk's seconds, FLOPs and bytes on its request (a
        draft model's passes on the chunks they ran for)."""
        works = [_chunk_work(c) for c in output.chunks]
        ids = [c.request_id for c in output.chunks]
        charge = self.meter.charge_step(
            works,
            duration,
            expert_bytes_run,
            draft_flops=[drafted.flops.get(rid, 0.0) for rid in ids],
            draft_bytes=[drafted.bytes.get(rid, 0.0) for rid in ids],
        )
        for chunk, seconds, flops, nbytes in zip(
            output.chunks,
            charge.chunk_seconds,
            charge.cost.chunk_flops,
            charge.cost.chunk_bytes,
            strict=True,
        ):
            request = self.scheduler.get_request(chunk.request_id)
            if request is None:
                continue
            if chunk.is_decode:
                request.cost.decode_seconds += seconds
                request.cost.decode_flops += flops
                request.cost.decode_bytes += nbytes
            else:
                request.cost.prefill_seconds += seconds
                request.cost.prefill_flops += flops
                request.cost.prefill_bytes += nbytes
        return charge

    def _stats(
        self, output, charge: StepCharge, started, duration, executed, drafted=NO_DRAFT_COST
    ) -> StepStats:
        cost = charge.cost
        return StepStats(
            started_at=started,
            duration_s=duration,
            num_prefill_tokens=output.num_prefill_tokens,
            num_decode_tokens=output.num_decode_tokens + output.num_draft_tokens,
            num_prefill_chunks=sum(1 for c in output.chunks if not c.is_decode),
            num_decode_requests=output.num_decode_tokens,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=output.num_preemptions,
            prefix_cache_queried_tokens=output.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=output.prefix_cache_hit_tokens,
            num_window_freed_blocks=output.num_window_freed_blocks,
            prefill_flops=cost.prefill_flops,
            decode_flops=cost.decode_flops,
            prefill_bytes=cost.prefill_bytes,
            decode_bytes=cost.decode_bytes,
            prefill_seconds=charge.prefill_seconds,
            decode_seconds=charge.decode_seconds,
            num_forward_passes=executed.num_forward_passes,
            num_draft_tokens=output.num_draft_tokens,
            num_drafting_requests=output.num_drafting_requests,
            num_accepted_draft_tokens=executed.runner_output.num_accepted_draft_tokens,
            num_draft_backoffs=self._take_draft_backoffs(),
            num_draft_model_passes=drafted.num_passes,
            draft_model_seconds=drafted.seconds,
        )

    def _take_draft_backoffs(self) -> int:
        total = self.scheduler.num_draft_backoffs_total
        new, self._draft_backoffs_seen = total - self._draft_backoffs_seen, total
        return new

    # -- facts for the server and tests -------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache.usage

    @property
    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions_total

    def check_invariants(self) -> None:
        self.kv_cache.check_invariants()


_NO_EXECUTION = ExecuteResult(RunnerOutput(), {}, 0)


def _chunk_work(chunk) -> ChunkWork:
    return ChunkWork(
        num_new_tokens=len(chunk.token_ids),
        context_len=chunk.context_len,
        samples=chunk.samples,
        is_decode=chunk.is_decode,
        num_prompt_logprob_rows=chunk.num_prompt_logprob_rows,
        num_draft_tokens=chunk.num_draft_tokens,
    )


def _why(exc: BaseException) -> str:
    return f"model step failed: {type(exc).__name__}: {exc}"


def _max_model_len(hf_config, configured: int | None) -> int:
    # Sliding windows do not bound the context: attention honours them
    # (engine/sliding_windows.py).
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if configured is not None:
        if configured > limit:
            raise ValueError(f"max_model_len {configured} exceeds the model's limit {limit}")
        return configured
    return limit


def _eos_token_ids(hf_config, tokenizer, generation_config=None) -> frozenset[int]:
    """Every id that ends a request: the union of config.json's, the tokenizer's and
    generation_config.json's EOS ids (chat models often list their end-of-turn token only
    in the last, as vLLM reads it)."""
    ids: set[int] = set()
    for source in (
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


def _long_prefill_threshold(config: EngineConfig) -> int:
    if config.long_prefill_token_threshold is None:
        return max(1, config.max_num_batched_tokens // 2)
    return config.long_prefill_token_threshold
