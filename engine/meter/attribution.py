"""split_step_time: a step's measured wall time split among its chunks by roofline time.

Every chunk of a step gets a modelled time, the roofline bound of its own work

    t_i = max(flops_i / peak_flops, bytes_i / peak_bytes_per_second)

and the step's measured duration T is split in proportion: seconds_i = T * t_i / sum(t).
bytes_i is the chunk's share of the step's weight read (by new-token share, see CostModel)
plus its own KV read and write, so

- a pure prefill or a pure decode step is all that phase's, and equal decodes split evenly;
- a decode row at a long context, bound by its KV reads, is charged its bandwidth time,
  which a FLOPs-share split would miss (it carries few FLOPs);
- a prefill chunk batched with decodes is charged its compute, the decodes their compute or
  KV time, whichever binds; the shared weight read is split by tokens.

Known error: the per-chunk bounds ignore that one chunk's compute can overlap another's
memory traffic, and time outside the model (scheduling, sampling, Python) is spread in the
same proportion. The shares always sum to T exactly, so per-request seconds add up to the
engine's busy seconds.
"""

from __future__ import annotations


def roofline_seconds(
    flops: float, num_bytes: float, peak_flops: float, peak_bytes_per_second: float
) -> float:
    """The shortest time the work could take on a machine with these peaks."""
    return max(flops / peak_flops, num_bytes / peak_bytes_per_second)


def split_step_time(
    duration: float,
    chunk_flops: list[float],
    chunk_bytes: list[float],
    peak_flops: float,
    peak_bytes_per_second: float,
) -> list[float]:
    """Seconds of `duration` charged to each chunk; they sum to `duration`."""
    bounds = [
        roofline_seconds(f, b, peak_flops, peak_bytes_per_second)
        for f, b in zip(chunk_flops, chunk_bytes, strict=True)
    ]
    total = sum(bounds)
    if total <= 0.0:  # no modelled work at all: share the time evenly
        return [duration / len(bounds)] * len(bounds) if bounds else []
    return [duration * bound / total for bound in bounds]
