"""Tiny random-weight checkpoints of any family, and Hugging Face's greedy output on them.

Weights are drawn with a wider spread than transformers' init (std 0.02 makes every logit
nearly equal, so greedy decoding would ride on rounding noise); hf_greedy also returns the
smallest top-1/top-2 logit margin along HF's path, so a test can check that an equality
failure means a real bug, not a near-tie.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from scheduler.sampling_params import SamplingParams

VOCAB = 211
EOS = 1
MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 9, 17, 30)
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "eos_token_id": EOS,
    "bos_token_id": 0,
    "pad_token_id": 0,
}


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer whose ids are the vocabulary "t0".."t{VOCAB-1}"."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", bos_token="t0", eos_token=f"t{EOS}"
    )
    tokenizer.save_pretrained(path)


def save_random_model(config, path: Path, norm_center: float = 1.0):
    """The HF model of `config` with random weights (norm weights around norm_center: 0 for
    Gemma's 1 + w norms), saved with the tokenizer as a checkpoint directory at path."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(norm_center + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)
    return model


def stack_params() -> list[SamplingParams]:
    """Three requests that leave one by one (9, 7 and 5 tokens), greedy and seeded sampled, with
    logprobs: a decode stack test's steps of 3, 2 and 1 rows."""
    return [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=7, temperature=0.9, seed=4, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2),
    ]


def assert_stack_equals_layer_loop(llm, prompt_ids: list[list[int]], reading):
    """Runs the stack_params requests twice on llm, with its model's decode stack and with it
    detached, and checks that decode steps of 3, 2 and 1 rows ran in the stack and that both
    runs gave the same tokens and logprobs, bit for bit. Returns (reading(runner) after each
    step with the stack, the same without). Skips where the model has no decode stack."""
    import pytest

    runner, model = llm.engine.runner, llm.engine.runner.model
    stack, execute = model.decode_stack, runner.execute
    if stack is None:
        pytest.skip("no native decode stack on this machine")
    stack_rows, readings = [], []
    run = stack.run
    stack.run = lambda *args: stack_rows.append(args[0].shape[0]) or run(*args)

    def recorded(*args, **kwargs):
        out = execute(*args, **kwargs)
        readings.append(reading(runner))
        return out

    runner.execute = recorded
    try:
        with_stack = llm.generate(prompt_ids, stack_params())
        with_readings, readings[:] = list(readings), []
        model.decode_stack = None
        without = llm.generate(prompt_ids, stack_params())
    finally:
        model.decode_stack = stack
        del runner.execute
        del stack.run
    assert {1, 2, 3} <= set(stack_rows)
    for a, b in zip(with_stack, without, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
    assert [len(o.token_ids) for o in with_stack] == [9, 7, 5]
    return with_readings, readings


def assert_greedy_equals_oracle(
    path: Path, oracle, name: str, cpu_kernels: bool, attention_backend: str | None = None
):
    """The model at path (a checkpoint directory or a GGUF file) served in float32 gives HF
    `generate`'s greedy tokens on the oracle, token for token, for the prompts below (up to 30
    tokens; 4-token blocks, a 16-token step budget: chunked prefills beside decodes). The
    attention backend: auto with the kernels, else batched, unless named. Returns the engine
    and its outputs, and HF's tokens, for a caller's further checks."""
    from engine.llm import LLM

    expected = []
    for prompt in prompts():
        tokens, margin = hf_greedy(oracle, prompt)
        assert margin > 1e-3, f"{name}: HF's greedy path has a near-tie; pick another seed"
        expected.append(tokens)
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=16,
        cpu_kernels=cpu_kernels,
        attention_backend=attention_backend or ("auto" if cpu_kernels else "batched"),
    )
    outputs = llm.generate(prompts(), SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outputs] == expected
    llm.engine.check_invariants()
    return llm, outputs, expected


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(
    model, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS, ignore_eos: bool = False
) -> tuple[list[int], float]:
    """HF's greedy continuation and the smallest top-1/top-2 logit margin along it."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens if ignore_eos else None,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    margins = [float(torch.topk(step[0], 2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), min(margins)


def chosen_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """A Hugging Face model's float32 log-probability of each of `tokens` after the prompt
    and the tokens before it (one teacher-forced pass)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
