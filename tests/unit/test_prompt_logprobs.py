"""Prompt logprobs (SamplingParams.prompt_logprobs): which positions each chunk reports, once
each across chunked prefill and preemption, with the prefix cache bypassed (a fake runner);
the values against a dense Hugging Face forward's log_softmax (a tiny random-weight model);
and the LM-head FLOPs they add to the bill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.meter.cost_model import LOGIT_ROWS_PER_PASS, ChunkWork, CostModel, ModelShape
from kvcache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.output import RunnerOutput, SchedulerOutput, TokenEvent, TokenLogprobs
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams, SamplingParamsError
from scheduler.scheduler import Scheduler

FILLER = 7

# ------------------------------------------------------------------ scheduler, fake runner


def fake_run(out: SchedulerOutput) -> RunnerOutput:
    """Samples FILLER; reports prompt token p + 1 with logprob -(p + 1) for each position p."""
    result = RunnerOutput()
    for chunk in out.chunks:
        if chunk.samples:
            result.sampled_token_ids[chunk.request_id] = FILLER
        positions = range(chunk.prompt_logprobs_start, chunk.prompt_logprobs_end)
        if positions:
            result.prompt_logprobs[chunk.request_id] = [
                TokenLogprobs(token_id=chunk.prompt_token_ids[p + 1], logprob=-(p + 1.0))
                for p in positions
            ]
    return result


def make_scheduler(
    num_blocks: int = 64, max_num_batched_tokens: int = 2048
) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, block_size=4)
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, kv, clock=lambda: 0.0), kv


def add(sched: Scheduler, request_id: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("max_tokens", 3)
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    request = Request(request_id, prompt, sampling, arrival_time=0.0)
    sched.add_request(request)
    return request


def step(
    sched: Scheduler, kv: KVCacheManager, events: dict[str, list[TokenEvent]]
) -> SchedulerOutput:
    out = sched.schedule()
    for event in sched.update(out, fake_run(out)):
        events.setdefault(event.request_id, []).append(event)
    kv.check_invariants()
    return out


def reported(events: list[TokenEvent]) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for event in events for e in event.prompt_logprobs]


def test_one_chunk_reports_every_prompt_token_but_the_first() -> None:
    sched, kv = make_scheduler()
    prompt = list(range(100, 110))
    add(sched, "A", prompt, prompt_logprobs=2)
    add(sched, "B", list(range(200, 205)))
    events: dict[str, list[TokenEvent]] = {}
    out = step(sched, kv, events)
    a, b = out.chunks
    assert (a.prompt_logprobs_start, a.prompt_logprobs_end) == (0, 9)
    assert b.num_prompt_logprob_rows == 0  # B did not ask: no extra rows
    assert reported(events["A"]) == [(prompt[p], -float(p)) for p in range(1, 10)]
    assert events["A"][0].new_token_ids == [FILLER] and events["B"][0].prompt_logprobs == []
    out = step(sched, kv, events)  # decodes report nothing more
    assert [c.num_prompt_logprob_rows for c in out.chunks] == [0, 0]
    assert len(reported(events["A"])) == 9


def test_chunked_prefill_reports_each_position_once_in_order() -> None:
    sched, kv = make_scheduler(max_num_batched_tokens=4)
    prompt = list(range(100, 111))  # 11 tokens: chunks [0, 4), [4, 8), [8, 11)
    add(sched, "A", prompt, prompt_logprobs=0)
    events: dict[str, list[TokenEvent]] = {}
    ranges = []
    for _ in range(3):
        (chunk,) = step(sched, kv, events).chunks
        ranges.append((chunk.prompt_logprobs_start, chunk.prompt_logprobs_end, chunk.samples))
    # The last chunk's last row samples the first output token: positions stop at 9.
    assert ranges == [(0, 4, False), (4, 8, False), (8, 10, True)]
    # Chunks that sample nothing still hand their prompt logprobs over, in token-less events.
    assert [e.new_token_ids for e in events["A"]] == [[], [], [FILLER]]
    assert not any(e.finished for e in events["A"])
    assert reported(events["A"]) == [(prompt[p], -float(p)) for p in range(1, 11)]


def test_prompt_logprobs_bypass_the_prefix_cache() -> None:
    sched, kv = make_scheduler()
    prompt = list(range(100, 113))
    add(sched, "warm", prompt, max_tokens=1)
    events: dict[str, list[TokenEvent]] = {}
    step(sched, kv, events)  # computes and caches 3 full blocks, then finishes
    add(sched, "asks", prompt, max_tokens=1, prompt_logprobs=1)
    out = step(sched, kv, events)
    (chunk,) = out.chunks
    assert chunk.start_position == 0 and chunk.num_new_tokens == 13
    assert out.prefix_cache_queried_tokens == 0 and out.prefix_cache_hit_tokens == 0
    assert events["asks"][-1].num_cached_tokens == 0
    assert len(reported(events["asks"])) == 12
    add(sched, "plain", prompt, max_tokens=1)  # others still hit what "asks" cached
    out = step(sched, kv, events)
    assert out.chunks[0].start_position == 12 and out.prefix_cache_hit_tokens == 12


def test_preemption_mid_prefill_reports_nothing_twice() -> None:
    sched, kv = make_scheduler(num_blocks=3, max_num_batched_tokens=8)
    add(sched, "A", list(range(100, 104)), max_tokens=3)
    prompt = list(range(200, 212))
    b = add(sched, "B", prompt, max_tokens=2, prompt_logprobs=0)
    events: dict[str, list[TokenEvent]] = {}
    step(sched, kv, events)  # A [0, 4) and B [0, 4): B reports tokens 1..4
    out = step(sched, kv, events)  # A takes the last block; B cannot grow and preempts itself
    assert out.preempted_request_ids == ["B"] and b.num_computed_tokens == 0
    recomputed = []
    while not b.output_token_ids:
        out = step(sched, kv, events)
        recomputed += [c for c in out.chunks if c.request_id == "B" and c.start_position == 0]
    # Recomputed from 0 (its cached first block not taken), reporting only what is new.
    [chunk] = recomputed
    assert (chunk.prompt_logprobs_start, chunk.prompt_logprobs_end) == (4, 8)
    assert reported(events["B"]) == [(prompt[p], -float(p)) for p in range(1, 12)]


def test_prompt_logprobs_are_validated() -> None:
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(prompt_logprobs=21)
    assert raised.value.param == "prompt_logprobs"
    with pytest.raises(SamplingParamsError):
        SamplingParams(prompt_logprobs=-1)
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0


# ------------------------------------------------------------------------------ cost model


def test_each_prompt_logprob_row_costs_one_lm_head() -> None:
    shape = ModelShape(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1000,
        num_params=0,
        dtype_bytes=4,
        tie_word_embeddings=True,
    )
    model = CostModel(shape)
    plain = ChunkWork(num_new_tokens=8, context_len=8, samples=True, is_decode=False)
    asks = ChunkWork(8, 8, samples=True, is_decode=False, num_prompt_logprob_rows=7)
    assert plain.num_logit_rows == 1 and asks.num_logit_rows == 8
    mid = ChunkWork(4, 4, samples=False, is_decode=False, num_prompt_logprob_rows=4)
    assert mid.num_logit_rows == 4
    head_flops = 2 * 64 * 1000
    assert model.chunk_flops(asks) - model.chunk_flops(plain) == 7 * head_flops
    head_bytes = model.weight_bytes.head(1)
    one_pass = model.step_cost([asks]).total_bytes - model.step_cost([plain]).total_bytes
    assert one_pass == pytest.approx(head_bytes)  # the prompt rows' own LM-head pass
    many = ChunkWork(600, 600, True, False, num_prompt_logprob_rows=599)
    passes = -(-599 // LOGIT_ROWS_PER_PASS)
    plain_many = ChunkWork(600, 600, True, False)
    extra = model.step_cost([many]).total_bytes - model.step_cost([plain_many]).total_bytes
    assert extra == pytest.approx(passes * head_bytes)
    # Two chunks asking share one pass over 4 + 7 rows, its bytes split 4 : 7.
    with_rows = model.step_cost([mid, asks, plain]).chunk_bytes
    without = model.step_cost([ChunkWork(4, 4, False, False), plain, plain]).chunk_bytes
    extra_per_chunk = [w - o for w, o in zip(with_rows, without, strict=True)]
    assert extra_per_chunk == pytest.approx([head_bytes * 4 / 11, head_bytes * 7 / 11, 0.0])


# ----------------------------------------------------- the runner against Hugging Face

VOCAB = 211


def _save_tokenizer(path: Path) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", bos_token="t0", eos_token="t1"
    )
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """A random-weight llama (weights wide enough that logprobs are far from uniform)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.2 if name.endswith("norm.weight") else 0.15
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return model, path


def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, VOCAB]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[:-1]


def _run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]):
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    events: dict[str, list[TokenEvent]] = {r: [] for r in requests}
    while engine.has_unfinished_requests():
        for event in engine.step().events:
            events[event.request_id].append(event)
    return events


PROMPTS = {"short": 3, "mid": 11, "long": 30}


@pytest.mark.parametrize("budget", [2048, 8], ids=["one-chunk", "chunked-prefill"])
def test_runner_prompt_logprobs_match_hugging_face(tiny_model, budget: int) -> None:
    model, path = tiny_model
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=4,
            kv_cache_bytes=1 << 20,
            max_num_batched_tokens=budget,
        )
    )
    gen = torch.Generator().manual_seed(3)
    prompts = {k: torch.randint(2, VOCAB, (n,), generator=gen).tolist() for k, n in PROMPTS.items()}
    asks = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    requests = {k: (p, asks) for k, p in prompts.items()}
    requests["plain"] = (prompts["long"], SamplingParams(max_tokens=2, temperature=0.0))
    events = _run(engine, requests)
    assert not any(e.prompt_logprobs for e in events["plain"])
    for name, prompt in prompts.items():
        entries = [e for event in events[name] for e in event.prompt_logprobs]
        expected = _hf_prompt_logprobs(model, prompt)
        assert [e.token_id for e in entries] == prompt[1:]
        got = torch.tensor([e.logprob for e in entries])
        want = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4), (name, (got - want).abs().max())
        assert min(want.tolist()) < -2.0  # far from a uniform distribution's -5.35
        for i, entry in enumerate(entries):
            top = torch.topk(expected[i], 3)
            assert entry.top_token_ids == top.indices.tolist()
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
            assert entry.rank == int((expected[i] > expected[i, prompt[i + 1]]).sum()) + 1
    engine.check_invariants()
    assert engine.num_free_blocks == engine.kv_cache_info.num_blocks


def test_engine_bypasses_the_prefix_cache_and_bills_the_rows(tiny_model) -> None:
    model, path = tiny_model
    engine = EngineCore(
        EngineConfig(model=str(path), dtype="float32", block_size=4, kv_cache_bytes=1 << 20)
    )
    prompt = torch.randint(2, VOCAB, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    warm = _run(engine, {"warm": (prompt, plain)})["warm"][-1]
    asks = _run(engine, {"asks": (prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))})
    final = asks["asks"][-1]
    again = _run(engine, {"again": (prompt, plain)})["again"][-1]
    assert final.num_cached_tokens == 0 and again.num_cached_tokens == 20
    entries = [e for event in asks["asks"] for e in event.prompt_logprobs]
    want = _hf_prompt_logprobs(model, prompt).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in entries]), want, atol=1e-4)
    # Same prompt, no cache hit either way: the bill differs by 20 LM-head rows exactly.
    assert warm.num_cached_tokens == 0
    head_flops = 2 * engine.model_shape.hidden_size * engine.model_shape.vocab_size
    assert final.cost.prefill_flops - warm.cost.prefill_flops == pytest.approx(20 * head_flops)
