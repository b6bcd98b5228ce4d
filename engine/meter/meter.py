"""Meter: the engine's meter room. Turns each step into FLOPs, bytes and attributed seconds,
and holds what turns them into dollars (prices) and utilization (peaks).

No Prometheus here: server/metering/prometheus_export.py only exports what the meter and the engine
produce, and the HTTP layer gets each request's bill (engine/meter/billing.py) from the same prices,
so `usage.cost_usd` never depends on whether metrics are exported.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.meter.attribution import split_step_time
from engine.meter.config import MeterConfig
from engine.meter.cost_model import ChunkWork, CostModel, StepCost, with_added_work
from engine.meter.peaks import Peaks


@dataclass(frozen=True, slots=True)
class StepCharge:
    """One step's modelled work and its measured time split among the chunks (in order)."""

    cost: StepCost
    chunk_seconds: list[float]
    prefill_seconds: float
    decode_seconds: float


NO_CHARGE = StepCharge(StepCost(0.0, 0.0, 0.0, 0.0, [], []), [], 0.0, 0.0)


class Meter:
    """Owns the cost model, the peaks and the meter config. Stateless between steps."""

    def __init__(self, config: MeterConfig, cost_model: CostModel, peaks: Peaks) -> None:
        self.config = config
        self.cost_model = cost_model
        self.peaks = peaks

    def charge_step(
        self,
        chunks: list[ChunkWork],
        duration: float,
        expert_bytes_run: int | None = None,
        draft_flops: list[float] | None = None,
        draft_bytes: list[float] | None = None,
    ) -> StepCharge:
        """expert_bytes_run: bytes of the experts the step ran (CostModel.step_cost);
        draft_flops / draft_bytes: per chunk, a draft model's passes run for it this step
        (engine/draft_model.py), added to the chunk's own before the time is split."""
        cost = self.cost_model.step_cost(chunks, expert_bytes_run=expert_bytes_run)
        if draft_flops is not None and draft_bytes is not None:
            cost = with_added_work(cost, chunks, draft_flops, draft_bytes)
        seconds = split_step_time(
            duration,
            cost.chunk_flops,
            cost.chunk_bytes,
            self.peaks.flops_per_second,
            self.peaks.bytes_per_second,
        )
        prefill = sum(s for s, chunk in zip(seconds, chunks) if not chunk.is_decode)
        # Rounding must never make the decode share (duration - prefill) negative.
        prefill = min(prefill, duration)
        return StepCharge(cost, seconds, prefill, duration - prefill)
