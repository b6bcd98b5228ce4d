"""Greedy equivalence with Hugging Face: prompts, HF references, and the near-tie comparison.

A sequence may leave HF's path only at a near-tie: at the first position where the tokens
differ, each side's token must be among the other side's top-5 and, on each side, the two
tokens' log-probabilities must be within NEAR_TIE of each other. The rest of a diverged
sequence is not compared (both continue from different prefixes). Before the divergence, the
chosen token's log-probability must also agree with HF's within LOGPROB_TOLERANCE (fp32 runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.llm import GenerationOutput

TOP = 5
NEAR_TIE = 1e-3
LOGPROB_TOLERANCE = 1e-3
MAX_NEW_TOKENS = 24

# ~150 tokens shared by the chat prompts below: the prefix cache can serve its full blocks.
SYSTEM_PROMPT = (
    "You are Meridian, the support assistant of a small public library in a coastal town. "
    "Answer questions about opening hours, membership, borrowing rules, the reading room, "
    "children's story time, printing and the community events calendar. Be brief and "
    "friendly, use plain language, and never invent a policy: when you do not know, say so "
    "and suggest asking the front desk. Opening hours are 9 to 18 on weekdays and 10 to 14 "
    "on Saturdays; the library is closed on Sundays and public holidays. Members may borrow "
    "up to eight items for three weeks and renew them twice unless someone has reserved them. "
    "Late returns cost ten cents a day per item. Printing costs fifteen cents a page."
)

CHAT_QUESTIONS = [
    "When are you open on Saturday?",
    "How many books can I borrow at once, and for how long?",
    "I returned two books five days late. What do I owe?",
    "Can I renew a book that somebody else has reserved?",
    "Is there story time for toddlers?",
    "Hi!",
]

PLAIN_CHAT = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
]

TEXTS = [
    "Hello, my dear friend",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    (
        "Photosynthesis is the process by which green plants, algae and some bacteria turn "
        "light energy into chemical energy. In the leaves, chlorophyll absorbs mostly red and "
        "blue light, and the energy is used to split water and to fix carbon dioxide into "
        "sugars. The oxygen"
    ),
    (
        "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He had done it "
        "for forty-one years, through storms that shook the glass and calm nights when the sea lay "
        "flat as slate. The lamp was electric now, switched on by a timer in the village, and the "
        "harbour authority had written to him twice to say that his post no longer existed. Still "
        "he climbed. He polished the great lens with a chamois cloth, checked the logbook, and "
        "wrote the weather in a careful, slanting hand: wind from the south-west, visibility good, "
        "two fishing boats returning late. On the night this story begins, he noticed a light "
        "where no light should be, far out beyond the reef, low on the water and blinking in a "
        "pattern he did not recognise. Three short, a pause, two long. He watched it for an hour. "
        "Then he took down the old signal lamp from its hook, the one with the brass shutter that "
        "nobody had used since the war, and carried it out onto the gallery. The wind pulled at "
        "his coat. Below him the town was asleep, its windows dark, and the only sound was the sea "
        "working patiently at the rocks. He raised the lamp, opened the shutter, and answered. "
        "For a long moment nothing happened. Then the distant light went out, and when it came "
        "back it was brighter, closer, and it was"
    ),
    "Translate to French: I would like a cup of coffee and a croissant, please.",
    "List three prime numbers greater than 100:",
]


def build_prompts(tokenizer) -> list[list[int]]:
    """16 prompts, ~5 to ~300 tokens: plain text, chat without and with the shared system."""
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    for question in PLAIN_CHAT:
        prompts.append(_chat(tokenizer, [{"role": "user", "content": question}]))
    for question in CHAT_QUESTIONS:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ]
        prompts.append(_chat(tokenizer, messages))
    return prompts


def _chat(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass(slots=True)
class Reference:
    """HF greedy continuation with, per generated position, the top-5 of log_softmax."""

    token_ids: list[int]
    logprobs: list[float]  # of the chosen token
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int):
    """HF `generate` greedily over all prompts at once, left-padded: per prompt, its new tokens
    (through its first EOS) and the logits HF chose them from, [tokens, vocab] in the model's
    dtype. One batched call instead of one per prompt: batch-1 decoding is memory-bound, so 16
    rows cost what one does (measured 27 -> 13 s in float32 and 65 -> 10 s in bfloat16, one
    thread). Padding changes no real position's inputs (masked keys, positions counted from the
    mask); in float32 the batched tokens equal the per-prompt ones (16 of 16, log-probabilities
    within 2e-5), in bfloat16 the larger products round differently, as any other valid bf16
    run does (see test_bf16_equivalence.py)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=eos_token_id,
    )
    results = []
    for row in range(len(prompts)):
        token_ids = out.sequences[row, width:].tolist()
        if eos_token_id in token_ids:  # a finished row goes on with padding
            token_ids = token_ids[: token_ids.index(eos_token_id) + 1]
        logits = torch.stack([step[row] for step in out.logits[: len(token_ids)]])
        kept = logits.to(model.dtype)  # float32 copies of the model's logits: exact
        assert torch.equal(kept.float(), logits.float())
        results.append((token_ids, kept))
    return results


def hf_greedy_references(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int):
    """Reference (top-5 log-probabilities per position) for each prompt, batched."""
    refs = []
    for token_ids, logits in hf_greedy_batch(model, prompts, max_new_tokens, eos_token_id):
        ref = Reference(token_ids, [], [], [])
        for step, token_id in zip(logits, token_ids, strict=True):
            logprobs = torch.log_softmax(step.float(), dim=-1)
            top = torch.topk(logprobs, TOP)
            ref.logprobs.append(float(logprobs[token_id]))
            ref.top_token_ids.append(top.indices.tolist())
            ref.top_logprobs.append(top.values.tolist())
        refs.append(ref)
    return refs


@dataclass(slots=True)
class Comparison:
    """How one of our outputs relates to HF's: equal, a near-tie divergence, or a failure."""

    index: int
    equal: bool = False
    diverged_at: int | None = None
    problems: list[str] = field(default_factory=list)


def compare(index: int, ours: GenerationOutput, ref: Reference, check_logprobs: bool) -> Comparison:
    result = Comparison(index)
    if ours.finish_reason not in ("stop", "length"):
        result.problems.append(f"finished {ours.finish_reason!r}: {ours.error}")
        return result
    for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
        if a != b:
            result.diverged_at = i
            _check_near_tie(result, ours, ref, i)
            return result
        if check_logprobs and ours.logprobs:
            diff = abs(ours.logprobs[i].logprob - ref.logprobs[i])
            if diff > LOGPROB_TOLERANCE:
                result.problems.append(f"position {i}: logprob differs from HF's by {diff:.2e}")
    if len(ours.token_ids) != len(ref.token_ids):
        result.problems.append(
            f"lengths differ without divergence: ours {len(ours.token_ids)} "
            f"({ours.finish_reason}), HF {len(ref.token_ids)}"
        )
    result.equal = not result.problems
    return result


def _check_near_tie(result: Comparison, ours: GenerationOutput, ref: Reference, i: int) -> None:
    a, b = ours.token_ids[i], ref.token_ids[i]
    our_top = dict(zip(ours.logprobs[i].top_token_ids, ours.logprobs[i].top_logprobs))
    hf_top = dict(zip(ref.top_token_ids[i], ref.top_logprobs[i]))
    if b not in our_top or a not in hf_top:
        result.problems.append(
            f"position {i}: ours {a}, HF {b}: not in each other's top-{TOP} "
            f"(ours {our_top}, HF {hf_top})"
        )
        return
    gaps = (abs(our_top[a] - our_top[b]), abs(hf_top[a] - hf_top[b]))
    if max(gaps) > NEAR_TIE:
        result.problems.append(
            f"position {i}: ours {a}, HF {b}: not a near-tie (logprob gaps ours {gaps[0]:.2e}, "
            f"HF {gaps[1]:.2e})"
        )


def assert_equivalent(
    outputs: list[GenerationOutput], refs: list[Reference], check_logprobs: bool = True
) -> list[Comparison]:
    """Fail with every problem listed; returns the comparisons (for summaries)."""
    assert len(outputs) == len(refs)
    results = [
        compare(i, ours, ref, check_logprobs)
        for i, (ours, ref) in enumerate(zip(outputs, refs, strict=True))
    ]
    problems = [f"prompt {r.index}: {p}" for r in results for p in r.problems]
    assert not problems, "\n".join(problems)
    diverged = [(r.index, r.diverged_at) for r in results if r.diverged_at is not None]
    print(
        f"{len(results) - len(diverged)} equal, near-tie divergences (prompt, position): {diverged}"
    )
    return results
