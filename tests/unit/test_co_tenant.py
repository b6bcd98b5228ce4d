"""The benchmark's co-tenant: a busy child process for exactly the body of the context."""

from __future__ import annotations

import multiprocessing
import time

from engine.co_tenant import co_tenant


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def test_the_co_tenant_spins_inside_the_context_and_is_gone_after() -> None:
    with co_tenant():
        (child,) = multiprocessing.active_children()
        deadline = time.monotonic() + 30
        while _cpu_seconds(child.pid) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)  # a spawned interpreter needs a moment to start spinning
        assert _cpu_seconds(child.pid) >= 0.05
    assert not child.is_alive() and multiprocessing.active_children() == []


def test_disabled_it_starts_nothing() -> None:
    with co_tenant(enabled=False):
        assert multiprocessing.active_children() == []
