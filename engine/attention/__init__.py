"""Paged attention backends. Each one writes the step's K/V at its slots, then attends."""

from __future__ import annotations

from engine.attention.batched import BatchedAttention
from engine.attention.reference import ReferenceAttention

BACKENDS = {"reference": ReferenceAttention, "batched": BatchedAttention}


def make_backend(name: str):
    if name == "auto":
        name = "batched"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()
