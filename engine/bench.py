"""`meterserve bench`: offline throughput of meterserve vs Hugging Face generate, side by side.

Both run in this process on the same weights, dtype and prompts:
- batch: N requests of P prompt tokens generating exactly G tokens each; meterserve gets them
  all at once (continuous batching), HF runs them as one static batch (no padding: equal
  lengths). Output tokens/s = N * G / wall time.
- single stream: one request; decode tokens/s measured after the first token
  (meterserve from its engine timestamps, HF as (t(G+1 tokens) - t(1 token)) / G).
- decoding: greedy by default; --temperature > 0 (with --top-p) samples, in both systems. With
  --seed S, batch request i gets seed S + i (the single stream S + N), so a run is reproducible.
- model: --model (default: the embedded SmolLM2-135M), or --random-model 0.5b|1.5b: a random-
  weight Llama of that size (engine/bench_models.py), built into --model-dir (default under
  $METERSERVE_CACHE_DIR) unless already there, then loaded through the real loader.
- --co-tenant: both measurements run beside a process spinning on one core, as a busy
  neighbour would; the engine's thread governor (engine/thread_governor.py) should give it
  its core.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.bench_models import RANDOM_MODELS, build_random_llama, default_random_model_dir
from engine.co_tenant import co_tenant
from engine.config import EngineConfig
from engine.llm import LLM
from engine.loader import hf_checkpoint_dir
from engine.model_runner import resolve_dtype
from scheduler.sampling_params import SamplingParams, SamplingParamsError

PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way. There were a king with a large jaw and a "
    "queen with a plain face, on the throne of England; there were a king with a large jaw and a "
    "queen with a fair face, on the throne of France. In both countries it was clearer than "
    "crystal to the lords of the State preserves of loaves and fishes, that things in general "
    "were settled for ever. "
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meterserve bench", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--random-model",
        choices=sorted(RANDOM_MODELS),
        help="bench a random-weight Llama of this size instead of --model",
    )
    parser.add_argument(
        "--model-dir", help="where --random-model is built (default: under the cache dir)"
    )
    parser.add_argument(
        "--co-tenant",
        action="store_true",
        help="measure beside a process that keeps one core busy (engine/co_tenant.py)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: bfloat16 where the CPU computes it natively, else float32 (as serve does)",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--single-stream-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling")
    parser.add_argument(
        "--seed", type=int, default=None, help="request i samples with seed+i (default: unseeded)"
    )
    parser.add_argument("--skip-hf", action="store_true", help="measure meterserve only")
    args = parser.parse_args(argv)
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p)
    except SamplingParamsError as exc:
        parser.error(str(exc))
    if args.random_model is not None and args.model != "default":
        parser.error("--random-model and --model name different models; pass one")
    if args.model_dir is not None and args.random_model is None:
        parser.error("--model-dir is where --random-model is built; it needs --random-model")
    return args


def model_path(args) -> str:
    """The model to bench: --model, or the --random-model checkpoint (built if missing)."""
    if args.random_model is None:
        return args.model
    directory = args.model_dir or default_random_model_dir(args.random_model)
    return str(build_random_llama(RANDOM_MODELS[args.random_model], Path(directory)))


def decoding_label(args) -> str:
    if args.temperature == 0.0:
        return "greedy"
    seed = "unseeded" if args.seed is None else f"seed {args.seed}+i"
    return f"sampled (temperature {args.temperature:g}, top_p {args.top_p:g}, {seed})"


def request_params(args, count: int, max_tokens: int, first: int = 0) -> list[SamplingParams]:
    """One SamplingParams per request; request `first + i` gets seed + first + i when seeded."""
    return [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=None if args.seed is None else args.seed + first + i,
            ignore_eos=True,
        )
        for i in range(count)
    ]


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct real-text prompts of exactly `length` tokens (sliding windows)."""
    ids = tokenizer.encode(PASSAGE * (2 + (count + length) // 100), add_special_tokens=False)
    return [ids[i * 3 : i * 3 + length] for i in range(count)]


def make_llm(args) -> LLM:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=max(args.num_requests, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        keep_freed_memory=True,  # as `meterserve serve` runs (engine/freed_memory.py)
    )
    return LLM(config)


def bench_meterserve(args, llm: LLM, prompts) -> dict[str, float]:
    exact = request_params(args, len(prompts), args.output_tokens)
    llm.generate(prompts[:4], request_params(args, 4, 8))  # warm-up, same decoding path
    started = time.perf_counter()
    outputs = llm.generate(prompts, exact)
    batch_seconds = time.perf_counter() - started
    produced = sum(len(o.token_ids) for o in outputs)
    single = request_params(args, 1, args.single_stream_tokens + 1, first=len(prompts))[0]
    single_tok_s = _single_stream_meterserve(llm, prompts[0], single)
    return {
        "meterserve_tok_s": produced / batch_seconds,
        "meterserve_batch_seconds": batch_seconds,
        "output_tokens": produced,
        "meterserve_single_stream_tok_s": single_tok_s,
    }


def _single_stream_meterserve(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    engine = llm.engine
    engine.add_request("bench-single", prompt, params)
    first = last = None
    count = 0
    while engine.has_unfinished_requests():
        for event in engine.step().events:
            count += len(event.new_token_ids)
            if event.finished and event.times is not None:
                first, last = event.times.first_token, event.times.last_token
    return (count - 1) / (last - first)


def bench_hf(args, prompts) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    checkpoint_dir = hf_checkpoint_dir(args.model)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype).eval()
    if args.seed is not None:
        torch.manual_seed(args.seed)  # HF draws from torch's global generator
    batch = torch.tensor(prompts)
    _hf_generate(model, batch[:4], 8, args)
    started = time.perf_counter()
    out = _hf_generate(model, batch, args.output_tokens, args)
    batch_seconds = time.perf_counter() - started
    produced = (out.shape[1] - batch.shape[1]) * out.shape[0]
    one = batch[:1]
    started = time.perf_counter()
    _hf_generate(model, one, 1, args)
    first_seconds = time.perf_counter() - started
    started = time.perf_counter()
    _hf_generate(model, one, args.single_stream_tokens + 1, args)
    total_seconds = time.perf_counter() - started
    return {
        "hf_tok_s": produced / batch_seconds,
        "hf_batch_seconds": batch_seconds,
        "hf_single_stream_tok_s": args.single_stream_tokens / (total_seconds - first_seconds),
    }


def hf_decoding_kwargs(args) -> dict:
    """HF generate's arguments for the same decoding as meterserve's (top_k off: HF's default
    of 50 would truncate what meterserve does not)."""
    if args.temperature == 0.0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": 0}


def _hf_generate(model, input_ids: torch.Tensor, new_tokens: int, args) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **hf_decoding_kwargs(args),
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    args.model = model_path(args)
    args.dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")  # HF runs the same
    llm = make_llm(args)
    prompts = make_prompts(llm.tokenizer, args.num_requests, args.prompt_tokens)
    figures: dict[str, float | int | str | None] = {
        "model": llm.engine.model_name,
        "num_params": llm.engine.runner.num_params,
        "requests": args.num_requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens_per_request": args.output_tokens,
        "dtype": args.dtype,
        "decoding": "greedy" if args.temperature == 0.0 else "sampled",
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
    }
    print(f"decoding: {decoding_label(args)}", flush=True)
    with co_tenant(args.co_tenant):
        figures.update(bench_meterserve(args, llm, prompts))
    governor = llm.engine.thread_governor
    figures["co_tenant"] = args.co_tenant
    figures["threads_at_end"] = governor.threads if governor else torch.get_num_threads()
    del llm  # free its KV cache before the baseline runs
    print(
        f"meterserve: {figures['meterserve_tok_s']:.1f} output tok/s over {args.num_requests} "
        f"requests; single stream {figures['meterserve_single_stream_tok_s']:.1f} tok/s",
        flush=True,
    )
    if not args.skip_hf:
        with co_tenant(args.co_tenant):
            figures.update(bench_hf(args, prompts))
        figures["throughput_ratio"] = figures["meterserve_tok_s"] / figures["hf_tok_s"]
        figures["single_stream_ratio"] = (
            figures["meterserve_single_stream_tok_s"] / figures["hf_single_stream_tok_s"]
        )
        print(
            f"hf generate: {figures['hf_tok_s']:.1f} output tok/s (static batch); single stream "
            f"{figures['hf_single_stream_tok_s']:.1f} tok/s"
        )
        print(
            f"ratios: throughput {figures['throughput_ratio']:.2f}x, single stream "
            f"{figures['single_stream_ratio']:.2f}x"
        )
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
