"""Paged attention backends. Each one writes the step's K/V at its slots, then attends."""

from __future__ import annotations

from engine.attention.batched import BatchedAttention
from engine.attention.cpu_kernel import CpuKernelAttention
from engine.attention.reference import ReferenceAttention

BACKENDS = ("reference", "batched", "cpu_kernels")


def make_backend(name: str, kernels=None):
    """auto = the native kernels when they are built, else the batched plain-torch backend."""
    if name == "auto":
        name = "cpu_kernels" if kernels is not None else "batched"
    if name == "reference":
        return ReferenceAttention()
    if name == "batched":
        return BatchedAttention()
    if name == "cpu_kernels":
        if kernels is None:
            raise ValueError("attention backend 'cpu_kernels' needs the native CPU kernels")
        return CpuKernelAttention(kernels)
    raise ValueError(f"unknown attention backend {name!r}; choose from {list(BACKENDS)}")
