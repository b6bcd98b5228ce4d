"""Paged attention backends. Each one writes the step's K/V at its slots, then attends."""

from __future__ import annotations

from engine.attention.avx2_kernel import Avx2Attention
from engine.attention.batched import BatchedAttention
from engine.attention.cpu_kernel import CpuKernelAttention
from engine.attention.reference import ReferenceAttention

BACKENDS = ("reference", "batched", "cpu_kernels", "avx2")


def make_backend(name: str, kernels=None, avx2=None):
    """auto = the native kernels when they are built, else the AVX2 kernels' decode attention
    when those are (CPUs without AVX-512), else the batched plain-torch backend."""
    if name == "auto":
        name = "cpu_kernels" if kernels is not None else "avx2" if avx2 is not None else "batched"
    if name == "reference":
        return ReferenceAttention()
    if name == "batched":
        return BatchedAttention()
    if name == "cpu_kernels":
        if kernels is None:
            raise ValueError("attention backend 'cpu_kernels' needs the native CPU kernels")
        return CpuKernelAttention(kernels)
    if name == "avx2":
        if avx2 is None:
            raise ValueError("attention backend 'avx2' needs the AVX2 kernels")
        return Avx2Attention(avx2)
    raise ValueError(f"unknown attention backend {name!r}; choose from {list(BACKENDS)}")
