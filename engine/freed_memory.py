"""keep_freed_memory: a step's large tensors reuse freed memory instead of fresh pages.

glibc's malloc serves a request above its mmap threshold (128 KB, rising to at most 32 MB)
with a fresh mmap and unmaps it on free. A prefill step allocates and frees several such
tensors a layer (a 2,048-token step of a 1.5B model: 8-59 MB each), so every step asked the
kernel for new pages, which it zeroes on first touch. Measured on a 2-core AMX Xeon, the random
1.5B bf16 Llama, 64 prompts of 128 tokens (four 2,048-token prefill steps): 1.16 M page faults
during the prefill steps (≈ 4.7 GB zeroed; perf, the model's load included, put 10 % of
the run in the kernel's clear_page); kept, 134 faults and the prefill steps 1.10-1.25× faster (14.8 / 15.5 s against
18.5 / 17.1 s); peak resident memory unchanged (+ 0.05 GB), at rest + 0.5 GB (the largest
step's working set stays). vLLM's CPU server gets the same from tcmalloc, which its docs have
users preload.

A thread's own malloc arena keeps its memory in heaps of at most 64 MB and maps anything larger
afresh whatever the settings (glibc's sysmalloc falls back to mmap there), so the server, whose
steps run on its engine thread, first has every thread share the main arena (share_one_arena,
before it starts any thread): measured, a thread's 100 MB tensor faulted in all its pages each
time with its own arena and none after the first with the main one.

The setting is process-wide and lasts. The engine applies it (EngineConfig.keep_freed_memory,
on for `meterserve serve` and `meterserve bench`) once the model and the KV cache are
allocated: what loading freed (casts, packing) has gone back to the system by then, so what
stays resident is the weights, the cache and the largest step's working set. Off by default for
a library caller, whose process may want its memory back.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_NEVER = 2**31 - 1  # the largest int: the top of the heap is never given back


def keep_freed_memory() -> bool:
    """Large allocations from the heap, and freed memory kept there for the next ones (glibc:
    M_MMAP_MAX = 0, M_TRIM_THRESHOLD at its maximum). True if applied; False on another C
    library, where nothing is changed."""
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) == 1
    log.debug("malloc keeps freed memory for reuse: %s", applied)
    return applied


def share_one_arena() -> bool:
    """Threads that make their first allocation after this one use the main arena (glibc:
    M_ARENA_MAX = 1), where keep_freed_memory holds for allocations of any size. True if
    applied."""
    mallopt = _glibc_mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1


def _glibc_mallopt():
    """glibc's mallopt, or None on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's malloc (a preloaded one's, if any)
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt
