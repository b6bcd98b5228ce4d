"""Scheduler: the continuous-batching policy over one token budget per step.

THE POLICY, in one place (knobs are SchedulerConfig fields):

1. Order. Running requests are served before waiting ones, in the running list's order:
   admission order under policy="fcfs", (priority, arrival_time) under policy="priority".
2. Budget. A step computes at most `max_num_batched_tokens` tokens, decodes and prefill chunks
   alike, and at most `max_num_seqs` requests are running at once.
3. Running requests get all their uncomputed tokens (1 for a decode, the rest of the prompt for
   a partially prefilled one), clipped to what is left of the budget; a prefill chunk is also
   clipped to leave one token for each decode behind it in the list, so a long prompt's
   prefill never holds back another request's next token, and to
   `long_prefill_token_threshold` (when set), so it never fills a step alone.
4. Preemption. When the KV cache cannot grow a running request, the tail of the running list
   is preempted (fcfs: the most recently admitted; priority: the least important), possibly
   the request itself, until the allocation fits. A preempted request drops its blocks and is
   recomputed from scratch later (its freed blocks stay cached, so a prefix hit usually gives
   most of them back). It goes to the front of the waiting queue (priority: back under its own
   key, ahead of later arrivals of its priority).
5. A step that preempted admits nobody: the blocks just freed would be fought over again.
6. Admission is strictly head-of-line: if the head of the waiting queue cannot be admitted
   (budget, seq cap, blocks), nothing behind it is, so a long prompt is never starved. Under
   fcfs each tenant (Request.tenant) has its own line and the head is that of the tenant with
   the fewest running requests (then the earliest arrival): one tenant's burst of prompts
   waits its turn instead of holding every other tenant's first token behind it.
   A prefix-cache hit counts as computed; only the rest is charged to the budget. A request
   that asks for prompt logprobs takes no hit (nor counts a lookup): cached positions would
   have no logits (vLLM does the same); its blocks are still cached for others. Hits are
   keyed by the request's cache_salt: only requests with the same salt share blocks.
7. Chunked prefill (`enable_chunked_prefill`): the rest of a prompt is cut to the budget left
   and to `long_prefill_token_threshold`; with it off, a request is admitted only when its
   whole rest fits in the step.
8. Requests that can never run fail (FINISHED_ERROR) instead of livelocking: one whose tokens
   need more blocks than the whole pool (seen when it alone holds blocks and still cannot
   grow), and, with chunked prefill off, one whose rest exceeds the whole step budget.
9. Sliding window (KVCacheManager.sliding_window, a fact of the model): before a request's
   chunk starting at position s gets its blocks, its blocks wholly before position s - W + 1
   are freed (no query of this or a later chunk sees them), so a request holds at most
   kvcache.window.max_live_blocks(W, chunk, block_size) blocks however long it runs, and
   rule 8 compares that, not its length, with the pool. Preemption still frees everything
   and recomputes from position 0.
10. Speculation (SchedulerConfig.speculative): a decode also carries up to
   num_speculative_tokens draft tokens (scheduler/ngram_proposer.py), clipped to the budget
   left after one token for each decode behind it, to its even share of
   SchedulerConfig.draft_step_rows (draft_step_rows // running requests - 1: where a pass of
   more rows takes a much dearer path, a few drafts for everyone beat many for one, as the
   first drafts are the likeliest accepted), to max_tokens and the context, and dropped
   when their KV blocks are not free (drafts never preempt anyone). A request with a
   structured output drafts too: the runner masks each draft's row after the drafts before it
   (engine/structured_output.py), so a draft its grammar refuses is never accepted.
   Drafts the model agrees with become tokens and computed positions in update(); the KV of
   rejected ones lies past num_computed_tokens and is overwritten by the next step. A decode
   whose drafts were all rejected makes its request skip drafting for its next 1, then 2, 4,
   ... decodes, up to SpeculativeConfig.max_backoff_steps; an accepted draft resets it
   (scheduler/draft_backoff.py): drafts that never land cost their rows for nothing.

Call update(output, runner_output) after every schedule(), even an empty one: requests failed
inside schedule() deliver their final event through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvcache.kv_cache_manager import ComputedBlocks, KVCacheManager
from scheduler.admission import admit_head
from scheduler.config import SchedulerConfig
from scheduler.drafting import record_drafts, scheduled_drafts
from scheduler.events import chunk_progress, token_event
from scheduler.fit_errors import unfittable_error
from scheduler.output import (
    RunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
    TokenEvent,
)
from scheduler.prompt_logprobs import ReportedPromptLogprobs
from scheduler.request import Request, RequestStatus
from scheduler.running_list import Fit, RunningList
from scheduler.sampled_tokens import append_sampled_tokens
from scheduler.scheduled_chunks import chunk_order, scheduled_chunk
from scheduler.waiting_queue import WaitingQueue


class Scheduler:
    """Owns every unfinished request and its status; decides each step who computes what.

    Guarantees: a request is in exactly one of waiting / running until it finishes; a finished
    request holds no blocks and appears once in a later SchedulerOutput.finished_request_ids.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._clock = clock
        self._requests: dict[str, Request] = {}  # unfinished requests only
        self._waiting = WaitingQueue(config.policy)
        self._running = RunningList(config.policy, kv_cache, self._waiting)  # rules 1 and 4
        self._finished_ids: list[str] = []  # since the last schedule()
        self._pending_events: list[TokenEvent] = []  # failures found in schedule()
        self._prompt_logprobs = ReportedPromptLogprobs()  # kept across preemption
        self._num_draft_backoffs_total = 0  # decodes whose rejected drafts began a backoff
        self._num_steps = 0  # outputs that computed something: SchedulerOutput.step_index
        self._queried_seen = kv_cache.prefix_cache_queried_tokens
        self._hit_seen = kv_cache.prefix_cache_hit_tokens
        self._window_freed_seen = kv_cache.num_window_freed_blocks

    # ----------------------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for what the caller must reject up front."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError("empty prompt")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len "
                f"{self.config.max_model_len} leaves no room for a completion token"
            )
        if request.status != RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} is not new")
        self._requests[request.request_id] = request
        self._waiting.add(request)

    def abort_request(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        error: str | None = None,
    ) -> TokenEvent | None:
        """Finish a request wherever it is and free its blocks; None if unknown or finished."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.mark_removed()
        self._finish(request, status, error)
        return token_event(request, None, None)

    def fail_requests(self, request_ids: list[str], error: str) -> list[TokenEvent]:
        events = (self.abort_request(i, RequestStatus.FINISHED_ERROR, error) for i in request_ids)
        return [event for event in events if event is not None]

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request (finished ones are handed over in their final event)."""
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_unfinished_requests(self) -> bool:
        """True while requests are queued or running, or a final event awaits update()."""
        return bool(self._requests) or bool(self._pending_events)

    @property
    def num_preemptions_total(self) -> int:
        return self._running.num_preemptions_total

    @property
    def num_draft_backoffs_total(self) -> int:
        return self._num_draft_backoffs_total

    # ----------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Build one step: running requests first (rules 3-4), then admissions (rules 5-8)."""
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, chunks, preempted)
        if not preempted:
            self._schedule_waiting(budget, chunks)
        kv = self.kv_cache
        if chunks:
            self._num_steps += 1
        output = SchedulerOutput(
            chunks=sorted(chunks, key=chunk_order),
            preempted_request_ids=preempted,
            finished_request_ids=self._finished_ids,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_preemptions=len(preempted),
            prefix_cache_queried_tokens=kv.prefix_cache_queried_tokens - self._queried_seen,
            prefix_cache_hit_tokens=kv.prefix_cache_hit_tokens - self._hit_seen,
            num_window_freed_blocks=kv.num_window_freed_blocks - self._window_freed_seen,
            step_index=self._num_steps if chunks else None,
        )
        self._finished_ids = []
        self._queried_seen = kv.prefix_cache_queried_tokens
        self._hit_seen = kv.prefix_cache_hit_tokens
        self._window_freed_seen = kv.num_window_freed_blocks
        return output

    def _schedule_running(
        self, budget: int, chunks: list[ScheduledChunk], preempted: list[str]
    ) -> int:
        decodes_behind = self._running.decodes_behind()
        draft_share = self._draft_share()
        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 1:  # rule 3: a prefill chunk leaves each later decode its token
                num_new = min(num_new, budget - decodes_behind[i], self.config.max_chunk_tokens)
                if num_new < 1:
                    i += 1
                    continue
            total = request.num_computed_tokens + num_new
            room = min(budget - 1 - decodes_behind[i], draft_share)
            drafts = scheduled_drafts(request, num_new, room, self.config, self.kv_cache)
            if not drafts and not self._allocate_or_preempt(request, total, preempted):
                break  # the request itself left the running list; it was the tail
            chunks.append(self._chunk(request, num_new, drafts))
            budget -= num_new + len(drafts)
            i += 1
        return budget

    def _draft_share(self) -> int:
        """The most drafts one decode of this step may carry under draft_step_rows (rule 10)."""
        rows = self.config.draft_step_rows
        if not rows or not self._running:
            return self.config.max_num_batched_tokens
        return max(0, rows // len(self._running) - 1)

    def _allocate_or_preempt(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Rule 4 (RunningList.allocate_or_preempt); False if the request was preempted, or
        failed because it alone does not fit (rule 8)."""
        fit = self._running.allocate_or_preempt(request, num_tokens, preempted)
        if fit is Fit.ALONE:
            start = request.num_computed_tokens  # unchanged: only others were preempted
            error = unfittable_error(self.kv_cache, request, start, num_tokens)
            self._fail_in_schedule(request, error)
        return fit is Fit.FITS

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        while budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.peek(self._running.num_of_tenant)
            if request is None or self.kv_cache.num_free_blocks == 0:
                return  # a hit is whole blocks and never the last token: 1 new block at least
            admission = admit_head(request, budget, self.config, self.kv_cache, len(self._running))
            if admission is None:
                return  # rule 6: nobody behind the head is admitted
            self._waiting.pop(request)
            if admission.error is not None:
                self._fail_in_schedule(request, admission.error)
                continue
            self._admit(request, admission.computed)
            chunks.append(self._chunk(request, admission.num_new, []))
            budget -= admission.num_new

    def _admit(self, request: Request, computed: ComputedBlocks) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = computed.num_tokens
        if request.times.first_scheduled is None:
            request.times.first_scheduled = self._clock()
            request.num_cached_tokens = computed.num_tokens
        self._running.add(request)

    def _chunk(self, request: Request, num_new: int, drafts: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        positions = self._prompt_logprobs.positions(request, start, start + num_new)
        block_table = self.kv_cache.block_table(request.request_id)
        return scheduled_chunk(request, num_new, drafts or [], block_table, positions)

    def _fail_in_schedule(self, request: Request, error: str) -> None:
        self._finish(request, RequestStatus.FINISHED_ERROR, error)
        self._pending_events.append(token_event(request, None, None))

    # ------------------------------------------------------------------------------- update

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[TokenEvent]:
        """Advance every scheduled request by its chunk, append sampled tokens, finish those
        that stop. Chunks of requests aborted since schedule() are skipped. A request with
        `report_progress` gets a ChunkProgress on each of its events, and a token-less
        progress event for each chunk that samples nothing (others get neither). A chunk with
        prompt-logprob positions hands its prompt logprobs over on its event, a token-less
        one for a chunk that samples nothing."""
        events, self._pending_events = self._pending_events, []
        now = self._clock()
        num_finished = 0
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request.num_computed_tokens != chunk.start_position
            ):
                continue  # aborted (maybe re-added under the same id) since schedule()
            request.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft_tokens
            self.kv_cache.cache_full_blocks(
                request.request_id,
                request.token_ids,
                request.num_computed_tokens,
                request.cache_salt,
            )
            progress = chunk.sampling_params.report_progress and output.step_index is not None
            prompt_logprobs = self._prompt_logprobs.take(chunk, runner_output)
            if chunk.samples:
                if record_drafts(request, chunk, runner_output, self.config.speculative):
                    self._num_draft_backoffs_total += 1
                max_len = self.config.max_model_len
                event = append_sampled_tokens(request, runner_output, max_len, now, self._finish)
                num_finished += request.is_finished
            elif progress or prompt_logprobs:
                event = token_event(request, None, None)  # a prefill chunk: no token
            else:
                continue
            event.prompt_logprobs = prompt_logprobs
            if progress:
                accepted = runner_output.accepted_draft_token_ids.get(chunk.request_id, ())
                event.progress = chunk_progress(output, chunk, request, now, len(accepted))
            events.append(event)
        if num_finished:
            self._running.drop_finished()
        return events

    # ------------------------------------------------------------------------------- finish

    def _finish(self, request: Request, status: RequestStatus, error: str | None) -> None:
        """Final state: blocks freed, unregistered, id queued for finished_request_ids. The
        caller takes the request out of the waiting queue or the running list."""
        request.status = status
        request.error = error
        request.times.finished = self._clock()
        self.kv_cache.free(request.request_id)
        self._prompt_logprobs.forget(request.request_id)
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)
