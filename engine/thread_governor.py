"""ThreadGovernor: as many compute threads as there are cores nobody else is using.

Every kernel and torch op of a step splits its work statically across the OpenMP threads and
ends at a barrier. When another process keeps one of the cores busy, the thread that shares a
core with it runs only in the slices the kernel scheduler gives it (milliseconds apart), and a
step of ~250 parallel regions waits for it ~250 times: measured on two cores with a busy
neighbour, 2 threads gave 26-57 tok/s where 1 thread gave 228-232 tok/s (quiet, 2 threads is
~1,100). Spin-free barriers (OMP_WAIT_POLICY=passive) only halve the loss.

So the engine measures the cores other processes use and runs on the rest: every `window_s`
it reads the machine's busy CPU time (/proc/stat, steal included: a VM neighbour is a
co-tenant too) and this process's own (os.times), and sets torch's thread count (which our
kernels' OpenMP regions share) to round(cores - others), at least 1. A change needs two windows
in a row to agree, so one burst does not flip it. Applied on the engine thread, before a step:
OpenMP's thread count is per calling thread.

Off when the operator fixed the count (EngineConfig.num_threads, OMP_NUM_THREADS): then the
fixed count runs whatever the neighbours do.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Seconds of CPU time since boot: the whole machine's busy time and this process's."""

    machine_busy: float
    own: float


def read_cpu_times() -> CpuTimes | None:
    """None where /proc/stat cannot be read (not Linux): the governor then stays put."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice: inside user/nice]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / _TICKS_PER_SECOND
    times = os.times()
    return CpuTimes(busy, times.user + times.system)


def threads_for(cores: int, others_busy: float) -> int:
    """Threads to run when other processes keep `others_busy` cores busy on `cores` cores."""
    return max(1, min(cores, round(cores - others_busy)))


class ThreadGovernor:
    """adjust() before each step; it does real work once per window."""

    def __init__(
        self,
        cores: int,
        window_s: float = 0.5,
        read: Callable[[], CpuTimes | None] = read_cpu_times,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = cores
        self.threads = cores
        self.window_s = window_s
        self._read, self._set_threads, self._clock = read, set_threads, clock
        self._last_time = clock()
        self._last = read()
        self._proposal: int | None = None
        self.others_busy = 0.0  # cores other processes used in the last window
        set_threads(cores)

    def adjust(self) -> int:
        """The thread count for the next step (changed only at a window's end)."""
        now = self._clock()
        if now - self._last_time < self.window_s:
            return self.threads
        sample = self._read()
        if sample is None or self._last is None:
            return self.threads
        wall = now - self._last_time
        others = (sample.machine_busy - self._last.machine_busy) - (sample.own - self._last.own)
        self._last, self._last_time = sample, now
        self.others_busy = max(0.0, others / wall)
        self._consider(threads_for(self.cores, self.others_busy))
        return self.threads

    def _consider(self, target: int) -> None:
        if target == self.threads:
            self._proposal = None
            return
        if self._proposal != target:  # the first window that asks for it: wait for a second
            self._proposal = target
            return
        log.info(
            "other processes use %.1f of %d cores: computing on %d threads (was %d)",
            self.others_busy, self.cores, target, self.threads,
        )  # fmt: skip
        self.threads, self._proposal = target, None
        self._set_threads(target)


def governor_for(num_threads: int | None) -> ThreadGovernor | None:
    """A governor up to torch's thread count (its default: the cores it may use), or None when
    the count is fixed or there is one thread anyway."""
    if num_threads is not None or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = torch.get_num_threads()
    return ThreadGovernor(cores) if cores > 1 else None
