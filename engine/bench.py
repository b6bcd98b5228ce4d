"""`meterserve bench`: offline throughput of meterserve vs Hugging Face generate, side by side.

Both run in this process on the same weights, dtype and prompts:
- batch: N requests of P prompt tokens generating exactly G tokens each; meterserve gets them
  all at once (continuous batching), HF runs them as one static batch (no padding: equal
  lengths). Output tokens/s = N * G / wall time.
- single stream: one request; decode tokens/s measured after the first token
  (meterserve from its engine timestamps, HF as (t(G+1 tokens) - t(1 token)) / G).
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.loader import hf_checkpoint_dir
from scheduler.sampling_params import SamplingParams

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
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--single-stream-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf", action="store_true", help="measure meterserve only")
    return parser.parse_args(argv)


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
    )
    return LLM(config)


def bench_meterserve(args, llm: LLM, prompts) -> dict[str, float]:
    exact = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    outputs = llm.generate(prompts, exact)
    batch_seconds = time.perf_counter() - started
    produced = sum(len(o.token_ids) for o in outputs)
    single = SamplingParams(
        max_tokens=args.single_stream_tokens + 1, temperature=0.0, ignore_eos=True
    )
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
    batch = torch.tensor(prompts)
    _hf_generate(model, batch[:4], 8)
    started = time.perf_counter()
    out = _hf_generate(model, batch, args.output_tokens)
    batch_seconds = time.perf_counter() - started
    produced = (out.shape[1] - batch.shape[1]) * out.shape[0]
    one = batch[:1]
    started = time.perf_counter()
    _hf_generate(model, one, 1)
    first_seconds = time.perf_counter() - started
    started = time.perf_counter()
    _hf_generate(model, one, args.single_stream_tokens + 1)
    total_seconds = time.perf_counter() - started
    return {
        "hf_tok_s": produced / batch_seconds,
        "hf_batch_seconds": batch_seconds,
        "hf_single_stream_tok_s": args.single_stream_tokens / (total_seconds - first_seconds),
    }


def _hf_generate(model, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    llm = make_llm(args)
    prompts = make_prompts(llm.tokenizer, args.num_requests, args.prompt_tokens)
    figures: dict[str, float | int | str] = {
        "requests": args.num_requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens_per_request": args.output_tokens,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    figures.update(bench_meterserve(args, llm, prompts))
    del llm  # free its KV cache before the baseline runs
    print(
        f"meterserve: {figures['meterserve_tok_s']:.1f} output tok/s over {args.num_requests} "
        f"requests; single stream {figures['meterserve_single_stream_tok_s']:.1f} tok/s",
        flush=True,
    )
    if not args.skip_hf:
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
