"""A co-tenant for benchmarks: a process that keeps one core busy for as long as it runs.

`meterserve bench --co-tenant` starts one around its measurements, so a run shows what a
neighbour on the same machine (another service, a build, a VM sharing the host) does to
throughput. The process pins itself to the last core this process may use and spins there;
it is a child that dies with its parent (and is stopped explicitly in `finally`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager


def _spin(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    x = 0
    while True:  # the parent terminates it
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


@contextmanager
def co_tenant(enabled: bool = True) -> Iterator[None]:
    """Run the body beside one busy core (a no-op when not enabled)."""
    if not enabled:
        yield
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    context = multiprocessing.get_context("spawn")  # no fork of a process holding threads
    process = context.Process(target=_spin, args=(cores[-1] if cores else None,), daemon=True)
    process.start()
    try:
        yield
    finally:
        process.terminate()
        process.join(timeout=5)
