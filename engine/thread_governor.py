"""ThreadGovernor: as many compute threads as there are cores nobody else is using.

Every kernel and torch op of a step splits its work statically across the OpenMP threads and
ends at a barrier. When another process keeps one of the cores busy, the thread that shares a
core with it runs only in the slices the kernel scheduler gives it (milliseconds apart), and a
step of ~250 parallel regions waits for it ~250 times: measured on two cores with a busy
neighbour, 2 threads gave 26-57 tok/s where 1 thread gave 228-232 tok/s (quiet, 2 threads is
~1,100). Spin-free barriers (OMP_WAIT_POLICY=passive) only halve the loss.

A container's CPU quota does the same to a step: once the threads have used the period's quota,
the cgroup is throttled until the next period. So the most threads is the cores this process
may use (`CpuLimits.cores`): the fewest of its affinity mask, its cgroup's cpuset, and its
cgroup CPU quota rounded up (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us / cpu.cfs_period_us; the
tightest along the cgroup path, since a parent's quota caps its children), and of torch's
default count.

Within that, the engine measures the cores other processes use and runs on the rest: every
`window_s` it reads the busy time of the CPUs in its affinity mask (their /proc/stat lines,
steal included: a VM neighbour is a co-tenant too) and this process's own (os.times), and sets
torch's thread count (which our kernels' OpenMP regions share) to round(cpus - others), at
least 1, at most the cores above. A change needs two windows in a row to agree, so one burst
does not flip it. Applied on the engine thread, before a step: OpenMP's thread count is per
calling thread.

Off when the operator fixed the count (EngineConfig.num_threads, OMP_NUM_THREADS): then the
fixed count runs whatever the neighbours do and whatever the quota.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
ROOT = Path("/")  # where /proc and /sys/fs/cgroup live; tests pass a fake tree
UNIFIED = ""  # cgroup v2's key in cgroup_dirs: its /proc/self/cgroup line names no controller


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Seconds of CPU time since boot: the busy time of the CPUs this process may run on
    (everyone's, ours included) and this process's own."""

    busy: float
    own: float


@dataclass(frozen=True, slots=True)
class CpuLimits:
    """The CPUs this process may run on and the CPU time its cgroups grant it.

    affinity: the scheduler's mask; others' busy time is measured over these CPUs.
    cpuset: the cgroup's CPUs (cpuset.cpus.effective), None where no cgroup names them.
    quota: cores' worth of CPU time per period, the tightest on the cgroup path; None: unlimited.
    """

    affinity: frozenset[int]
    cpuset: frozenset[int] | None
    quota: float | None

    @property
    def cores(self) -> int:
        """The most threads worth running at once. A fractional quota rounds up: two threads
        under a 1.5-core quota get 1.5 cores of work done per period, one thread only 1."""
        counts = [len(self.affinity)]
        if self.cpuset:  # the kernel keeps the mask inside it: a cross-check, rarely lower
            counts.append(len(self.cpuset))
        if self.quota is not None:
            counts.append(math.ceil(self.quota))
        return max(1, min(counts))


def parse_cpu_list(text: str) -> frozenset[int]:
    """The kernel's CPU list format: '0-1,4' is {0, 1, 4}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError:
        return None


def cgroup_dirs(root: Path = ROOT) -> dict[str, list[Path]]:
    """Per controller ("cpu", "cpuset"; UNIFIED for cgroup v2), this process's cgroup directory
    and each parent up to the hierarchy's mount, innermost first. Empty without cgroups.

    Missing directories stay in the list and read as no file: in a container without a cgroup
    namespace /proc/self/cgroup names the host's path while the mount shows only the
    container's own cgroup, whose files then sit at the mount itself, the last entry.
    """
    mount = root / "sys/fs/cgroup"
    dirs: dict[str, list[Path]] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        _hierarchy_id, controllers, path = line.split(":", 2)
        # v1 mounts one hierarchy per controller list (/sys/fs/cgroup/cpu,cpuacct); v2 one in all
        base = mount / controllers if controllers else mount
        parts = [part for part in path.split("/") if part]
        chain = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
        for controller in controllers.split(",") if controllers else [UNIFIED]:
            dirs[controller] = chain
    return dirs


def _v2_quota(cgroup: Path) -> float | None:
    """cpu.max is 'QUOTA PERIOD' in microseconds; QUOTA is 'max' when unlimited."""
    quota, _, period = (_read(cgroup / "cpu.max") or "max").partition(" ")
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(cgroup: Path) -> float | None:
    """cpu.cfs_quota_us is -1 when unlimited."""
    quota, period = _read(cgroup / "cpu.cfs_quota_us"), _read(cgroup / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) < 0:
        return None
    return int(quota) / int(period)


def cgroup_quota(dirs: dict[str, list[Path]]) -> float | None:
    """The tightest quota on the way to the root: a parent's quota caps all its children. A
    machine has the cpu controller in one hierarchy, so at most one of the two lists has files."""
    quotas = [_v2_quota(cgroup) for cgroup in dirs.get(UNIFIED, ())]
    quotas += [_v1_quota(cgroup) for cgroup in dirs.get("cpu", ())]
    return min((quota for quota in quotas if quota is not None), default=None)


def cgroup_cpuset(dirs: dict[str, list[Path]]) -> frozenset[int] | None:
    """The innermost cgroup's effective CPUs: a child's set lies inside its parent's."""
    files = [cgroup / "cpuset.cpus.effective" for cgroup in dirs.get(UNIFIED, ())]
    files += [cgroup / "cpuset.effective_cpus" for cgroup in dirs.get("cpuset", ())]  # v1
    for path in files:
        if text := _read(path):
            return parse_cpu_list(text)
    return None


def own_affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))  # no affinity masks (not Linux): every CPU


def read_cpu_limits(
    root: Path = ROOT, affinity: Callable[[], Iterable[int]] = own_affinity
) -> CpuLimits:
    dirs = cgroup_dirs(root)
    return CpuLimits(frozenset(affinity()), cgroup_cpuset(dirs), cgroup_quota(dirs))


def busy_ticks(stat: str, cpus: AbstractSet[int]) -> int:
    """Busy clock ticks of the given CPUs, from /proc/stat's per-CPU lines ('cpuN ...'; the
    first line, 'cpu ...', is the whole machine's and is skipped)."""
    total = 0
    for line in stat.splitlines():
        if not line.startswith("cpu"):
            break  # the CPU lines come first; the rest (intr: thousands of fields) is not ours
        name, *fields = line.split()
        if name[3:].isdigit() and int(name[3:]) in cpus:
            # cpuN user nice system idle iowait irq softirq steal [guest guest_nice: in user/nice]
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total


def read_cpu_times(cpus: AbstractSet[int], root: Path = ROOT) -> CpuTimes | None:
    """None where /proc/stat cannot be read (not Linux): the governor then stays put."""
    stat = _read(root / "proc/stat")
    if stat is None:
        return None
    times = os.times()
    return CpuTimes(busy_ticks(stat, cpus) / _TICKS_PER_SECOND, times.user + times.system)


def threads_for(cores: int, cpus: int, others_busy: float) -> int:
    """Threads to run when other processes keep `others_busy` of our `cpus` CPUs busy, at most
    `cores` (a quota can grant fewer cores than the CPUs we may run on)."""
    return max(1, min(cores, round(cpus - others_busy)))


class ThreadGovernor:
    """adjust() before each step; it does real work once per window. Never more threads than
    `cores`; `read` measures the busy time of the `cpus` CPUs this process may run on."""

    def __init__(
        self,
        cores: int,
        cpus: int,
        read: Callable[[], CpuTimes | None],
        window_s: float = 0.5,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = cores
        self.cpus = cpus
        self.threads = cores
        self.window_s = window_s
        self._read, self._set_threads, self._clock = read, set_threads, clock
        self._last_time = clock()
        self._last = read()
        self._proposal: int | None = None
        self.others_busy = 0.0  # CPUs other processes used in the last window
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
        others = (sample.busy - self._last.busy) - (sample.own - self._last.own)
        self._last, self._last_time = sample, now
        self.others_busy = max(0.0, others / wall)
        self._consider(threads_for(self.cores, self.cpus, self.others_busy))
        return self.threads

    def _consider(self, target: int) -> None:
        if target == self.threads:
            self._proposal = None
            return
        if self._proposal != target:  # the first window that asks for it: wait for a second
            self._proposal = target
            return
        log.info(
            "other processes use %.1f of our %d CPUs: computing on %d threads (was %d)",
            self.others_busy, self.cpus, target, self.threads,
        )  # fmt: skip
        self.threads, self._proposal = target, None
        self._set_threads(target)


def governor_for(
    num_threads: int | None, read_limits: Callable[[], CpuLimits] = read_cpu_limits
) -> ThreadGovernor | None:
    """A governor up to torch's thread count (its default: the CPUs of the affinity mask) and
    the container's cores, or None when the count is fixed or there is one thread anyway."""
    if num_threads is not None or os.environ.get("OMP_NUM_THREADS"):
        return None
    limits = read_limits()
    cores = min(torch.get_num_threads(), limits.cores)
    log.info(
        "CPU limits: %d CPUs in the affinity mask, cpuset of %s, quota of %s cores: "
        "at most %d compute threads",
        len(limits.affinity), len(limits.cpuset) if limits.cpuset else "-",
        f"{limits.quota:g}" if limits.quota is not None else "-", cores,
    )  # fmt: skip
    if cores == 1:  # torch's default ignores the quota: a 1-core container would throttle
        torch.set_num_threads(1)
        return None
    read = functools.partial(read_cpu_times, limits.affinity)
    return ThreadGovernor(cores, len(limits.affinity), read)
