"""One decode chunk that samples, as the sampler sees it: the shared builder of the sampler,
native-sampling and structured-output tests."""

from __future__ import annotations

from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams


def sampling_chunk(
    params: SamplingParams,
    request_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int = 0,
) -> ScheduledChunk:
    """The chunk that feeds the last of prompt + output and samples the next token."""
    prompt = [0, 1] if prompt is None else prompt
    output = [] if output is None else output
    return ScheduledChunk(
        request_id=request_id,
        token_ids=[(prompt + output)[-1]],
        start_position=len(prompt) + len(output) - 1,
        block_table=[0],
        samples=True,
        num_prompt_tokens=len(prompt),
        sampling_params=params,
        prompt_token_ids=prompt,
        output_token_ids=output,
        eos_token_ids=frozenset({eos}),
    )
