"""Perplexity of a model served in bf16 and with --quantization int8 / int4, over bundled text.

    python -m engine.perplexity [--model default] [--window 512] [--int8-head]

The text is the public-domain US Constitution and Declaration of Independence that the load
tester ships (loadtest/data). Each non-overlapping window of `window` tokens is one request
asking for its prompt logprobs (teacher-forced, the engine's own prefill path); perplexity is
exp(-mean logprob) over every token after each window's first. A GGUF model is measured three
ways: served natively from its blocks ("gguf"), and its float conversion (engine/loader.py's
hf_checkpoint_dir) in bf16 and with int8 (smoothed, the default; and "int8-rot", its rotation
alone, int8_smoothing=False), and int4; and, served from its blocks in passes of at most 8
tokens (max_num_batched_tokens=8, so every pass takes the decode kernels), with the exact
weights ("gguf-8") and with int8 inputs (--gguf-activations int8, "gguf-8-int8": the setting
only changes passes of 1-8 rows). --int8-head also swaps the LM head for an Int8Linear
(not a serving option: it measures what keeping the head bf16 saves). Prints one line per
setting and each one's ratio to bf16.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from torch import nn

from engine.llm import LLM
from engine.loader import hf_checkpoint_dir, resolve_model_path
from engine.models.int8_linear import Int8Linear
from scheduler.sampling_params import SamplingParams

TEXTS = ("declaration_of_independence.txt", "constitution_of_the_united_states.txt")
DATA_DIR = Path(__file__).resolve().parent.parent / "loadtest" / "data"


def text_token_ids(tokenizer) -> list[int]:
    text = "\n\n".join((DATA_DIR / name).read_text() for name in TEXTS)
    return tokenizer.encode(text, add_special_tokens=False)


def mean_logprob(llm: LLM, token_ids: list[int], window: int) -> tuple[float, int]:
    """(mean logprob, count) over every window's tokens after its first."""
    windows = [token_ids[i : i + window] for i in range(0, len(token_ids) - 1, window)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for index, ids in enumerate(w for w in windows if len(w) > 1):
        llm.engine.add_request(f"ppl-{index}", ids, params)
    total, count = 0.0, 0
    while llm.engine.has_unfinished_requests():
        for event in llm.engine.step().events:
            total += sum(entry.logprob for entry in event.prompt_logprobs)
            count += len(event.prompt_logprobs)
    return total / count, count


def int8_head(llm: LLM) -> None:
    """Replace a tied LM head by an Int8Linear of the bf16 embedding it shares."""
    model = llm.engine.runner.model
    if not model.shape.tie_word_embeddings:
        raise SystemExit("--int8-head: only for tied heads (the packed head keeps no bf16 copy)")
    weight = model.embed_tokens.weight.detach()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    model.lm_head = Int8Linear(linear, llm.engine.runner.kernels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--int8-head", action="store_true")
    args = parser.parse_args(argv)
    floats = str(hf_checkpoint_dir(args.model))  # the model itself unless it is a GGUF file
    whole = {"max_num_batched_tokens": max(2048, args.window)}
    settings = [
        ("bf16", floats, "none", False, True, whole),
        ("int8", floats, "int8", False, True, whole),
        ("int8-rot", floats, "int8", False, False, whole),
        ("int4", floats, "int4", False, True, whole),
    ]
    if args.int8_head:
        settings.append(("int8+head", floats, "int8", True, True, whole))
    if resolve_model_path(args.model).suffix == ".gguf":
        decode_sized = {"max_num_batched_tokens": 8}
        settings[:0] = [
            ("gguf", args.model, "none", False, True, whole),
            ("gguf-8", args.model, "none", False, True, decode_sized),
            (
                "gguf-8-int8",
                args.model,
                "none",
                False,
                True,
                {**decode_sized, "gguf_activations": "int8"},
            ),
        ]
    results: dict[str, float] = {}
    for name, model, quantization, head, smoothing, engine_args in settings:
        started = time.perf_counter()
        llm = LLM(
            model=model,
            dtype="bfloat16",
            quantization=quantization,
            int8_smoothing=smoothing,
            **engine_args,
        )
        if head:
            int8_head(llm)
        mean, count = mean_logprob(llm, text_token_ids(llm.tokenizer), args.window)
        results[name] = math.exp(-mean)
        seconds = time.perf_counter() - started
        print(f"{name:10s} perplexity {results[name]:.4f} over {count} tokens ({seconds:.0f} s)")
        del llm
    for name, value in results.items():
        if name != "bf16":
            print(f"{name} / bf16 = {value / results['bf16']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
