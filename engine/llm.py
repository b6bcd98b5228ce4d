"""LLM: offline batch generation that drives the same EngineCore the server uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from scheduler.output import TokenLogprobs
from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerationOutput:
    """One prompt's result: token ids, decoded text, why it ended."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    text: str = ""


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.engine = EngineCore(config or EngineConfig(**overrides))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams],
    ) -> list[GenerationOutput]:
        """Submit all prompts at once and step until every one has finished, in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, GenerationOutput] = {}
        for index, (prompt, prompt_params) in enumerate(zip(prompts, params_list, strict=True)):
            token_ids = self._encode(prompt)
            request_id = f"offline-{index}"
            outputs[request_id] = GenerationOutput(request_id, token_ids)
            self.engine.add_request(request_id, token_ids, prompt_params)
        while self.engine.has_unfinished_requests():
            for event in self.engine.step().events:
                output = outputs[event.request_id]
                output.token_ids.extend(event.new_token_ids)
                output.logprobs.extend(event.logprobs)
                if event.finished:
                    output.finish_reason, output.error = event.finish_reason, event.error
                    output.num_cached_tokens = event.num_cached_tokens
        for output in outputs.values():
            output.text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        return list(outputs.values())

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            # An empty string encodes to no tokens; the engine rejects that with a clear error.
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)
