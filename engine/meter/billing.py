"""Bill: what one API request consumed and is charged, from the engine's readings.

An API request runs one engine request per choice (n > 1, several prompts). Tokens are
counted as OpenAI's `usage` counts them: each prompt once, completion tokens as delivered to
the client (up to and including the token that completed a stop string). Tokens the engine
computed beyond that (after a stop string matched, after the client left or timed out) are
`undelivered`: not billed, but their compute stays in the request's seconds and cost.

cost_usd    = (prefill_seconds + decode_seconds + grammar_compile_seconds) * hardware price
              per second (usage basis)
            = prefill_cost_usd + decode_cost_usd (each phase's seconds * that price)
              + grammar_compile_seconds * that price (compiled for it before it ran)
revenue_usd = prompt_tokens * input price / 1e6 + completion_tokens * output price / 1e6
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import RequestCost


@dataclass(frozen=True, slots=True)
class Prices:
    """List prices in USD per 1M tokens (a tenant's plan or the server's defaults)."""

    input_per_million: float
    output_per_million: float


@dataclass(frozen=True, slots=True)
class ChoiceReading:
    """One engine request at its end: which prompt it continued, what it computed and what
    the client got. cost is None when the engine never reported back (engine failure)."""

    prompt_index: int
    num_cached_tokens: int
    num_computed_tokens: int  # output tokens the engine sampled
    num_delivered_tokens: int  # of which reached the client's response
    cost: RequestCost | None


@dataclass(frozen=True, slots=True)
class Bill:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    undelivered_tokens: int
    prefill_seconds: float
    decode_seconds: float
    flops: float
    cost_usd: float
    revenue_usd: float
    # The split of flops and cost_usd by phase (prefill: prompt chunks, the first token's
    # pass included; decode: one token per pass).
    prefill_flops: float = 0.0
    decode_flops: float = 0.0
    prefill_cost_usd: float = 0.0
    decode_cost_usd: float = 0.0
    # Compiling the request's grammar before it was submitted (0 on a cache hit): worker
    # time outside any step, so in cost_usd but not in the engine's busy seconds.
    grammar_compile_seconds: float = 0.0

    @property
    def busy_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def bill_request(
    prompt_lengths: list[int],
    choices: list[ChoiceReading],
    prices: Prices,
    hardware_price_per_second: float,
    grammar_compile_seconds: float = 0.0,
) -> Bill:
    """Sum the choices' readings into one bill (each prompt counted once; its cached tokens
    are the fewest any of its choices found, as the usage object reports them)."""
    cached_by_prompt: dict[int, int] = {}
    for choice in choices:
        seen = cached_by_prompt.get(choice.prompt_index, choice.num_cached_tokens)
        cached_by_prompt[choice.prompt_index] = min(seen, choice.num_cached_tokens)
    costs = [choice.cost for choice in choices if choice.cost is not None]
    prefill = sum(cost.prefill_seconds for cost in costs)
    decode = sum(cost.decode_seconds for cost in costs)
    prefill_flops = sum(cost.prefill_flops for cost in costs)
    decode_flops = sum(cost.decode_flops for cost in costs)
    prompt_tokens = sum(prompt_lengths)
    completion = sum(choice.num_delivered_tokens for choice in choices)
    undelivered = sum(
        max(choice.num_computed_tokens - choice.num_delivered_tokens, 0) for choice in choices
    )
    return Bill(
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(cached_by_prompt.values()),
        completion_tokens=completion,
        undelivered_tokens=undelivered,
        prefill_seconds=prefill,
        decode_seconds=decode,
        flops=prefill_flops + decode_flops,
        cost_usd=(prefill + decode + grammar_compile_seconds) * hardware_price_per_second,
        revenue_usd=(
            prompt_tokens * prices.input_per_million + completion * prices.output_per_million
        )
        / 1e6,
        prefill_flops=prefill_flops,
        decode_flops=decode_flops,
        prefill_cost_usd=prefill * hardware_price_per_second,
        decode_cost_usd=decode * hardware_price_per_second,
        grammar_compile_seconds=grammar_compile_seconds,
    )
