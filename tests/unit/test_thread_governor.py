"""ThreadGovernor on a fake clock and fake CPU counters: the thread count follows the cores
other processes leave free, never exceeds the container's cores, changes only after two windows
agree, and a fixed count turns it off. The container's cores come from fake cgroup trees under
tmp_path (v2 and v1 layouts); real /proc/stat is read once, for its shape."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.thread_governor import (
    CpuLimits,
    CpuTimes,
    ThreadGovernor,
    busy_ticks,
    governor_for,
    own_affinity,
    parse_cpu_list,
    read_cpu_limits,
    read_cpu_times,
    threads_for,
)

EIGHT_CPUS = frozenset(range(8))


class FakeMachine:
    """Advances time; each tick, this process and the others use the given cores."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.calls: list[int] = []

    def tick(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def read(self) -> CpuTimes:
        return CpuTimes(self.busy, self.own)


def _governor(machine: FakeMachine, cores: int = 2, cpus: int = 2) -> ThreadGovernor:
    return ThreadGovernor(
        cores, cpus, machine.read, window_s=0.5, set_threads=machine.calls.append,
        clock=lambda: machine.now,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cores", "cpus", "others", "threads"),
    [
        (2, 2, 0.0, 2), (2, 2, 0.3, 2), (2, 2, 0.7, 1), (2, 2, 1.0, 1), (2, 2, 2.0, 1),
        (8, 8, 2.2, 6), (8, 8, 0.4, 8),
        # a 2-core quota on 8 CPUs: others use the 6 we do not need before they cost a thread
        (2, 8, 0.0, 2), (2, 8, 5.0, 2), (2, 8, 6.4, 2), (2, 8, 6.7, 1), (2, 8, 8.0, 1),
    ],
)  # fmt: skip
def test_threads_are_the_cores_others_leave(cores, cpus, others, threads) -> None:
    assert threads_for(cores, cpus, others) == threads


def test_a_busy_neighbour_takes_a_thread_after_two_windows_and_gives_it_back() -> None:
    machine = FakeMachine()
    governor = _governor(machine)
    assert machine.calls == [2] and governor.threads == 2
    machine.tick(0.6, own_cores=1.3, other_cores=0.7)  # a busy process shares our 2 cores
    assert governor.adjust() == 2  # one window is not enough
    machine.tick(0.6, own_cores=1.3, other_cores=0.7)
    assert governor.adjust() == 1 and machine.calls == [2, 1]
    assert governor.others_busy == pytest.approx(0.7)
    machine.tick(0.6, own_cores=1.0, other_cores=0.0)  # it left
    assert governor.adjust() == 1
    machine.tick(0.6, own_cores=1.0, other_cores=0.0)
    assert governor.adjust() == 2 and machine.calls == [2, 1, 2]


def test_a_single_burst_changes_nothing_and_steps_inside_a_window_read_nothing() -> None:
    machine = FakeMachine()
    governor = _governor(machine)
    machine.tick(0.6, own_cores=1.0, other_cores=1.0)
    assert governor.adjust() == 2
    machine.tick(0.6, own_cores=2.0, other_cores=0.0)  # the burst is over: the proposal drops
    assert governor.adjust() == 2
    machine.tick(0.6, own_cores=1.0, other_cores=1.0)
    assert governor.adjust() == 2  # a new first window
    machine.tick(0.1, own_cores=1.0, other_cores=1.0)
    assert governor.adjust() == 2  # inside the window: no reading, no change
    assert machine.calls == [2]


def test_under_a_quota_neighbours_on_other_cpus_cost_nothing() -> None:
    machine = FakeMachine()
    governor = _governor(machine, cores=2, cpus=8)
    for _ in range(2):  # 3 of the 8 CPUs are free: room for both threads
        machine.tick(0.6, own_cores=2.0, other_cores=5.0)
        assert governor.adjust() == 2
    assert governor.others_busy == pytest.approx(5.0) and machine.calls == [2]
    machine.tick(0.6, own_cores=1.0, other_cores=7.0)  # 1 CPU free
    assert governor.adjust() == 2
    machine.tick(0.6, own_cores=1.0, other_cores=7.0)
    assert governor.adjust() == 1 and machine.calls == [2, 1]


def test_a_fixed_thread_count_turns_the_governor_off(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert governor_for(num_threads=2) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert governor_for(num_threads=None) is None


def test_proc_stat_reads_as_cpu_seconds() -> None:
    first = read_cpu_times(own_affinity())
    if first is None:
        pytest.skip("no /proc/stat here")
    second = first
    for _ in range(200):  # CPU time of our own, at least one clock tick of it
        sum(i * i for i in range(100_000))
        second = read_cpu_times(own_affinity())
        if second.own > first.own:
            break
    assert second.own > first.own  # the two clocks tick apart: only their direction is certain
    assert second.busy >= first.busy


def test_governor_for_runs_at_most_the_quota_and_one_thread_under_one_core(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # torch's default: every CPU
    try:
        governor = governor_for(None, read_limits=lambda: CpuLimits(EIGHT_CPUS, None, 1.5))
        assert governor is not None
        assert (governor.cores, governor.cpus, governor.threads) == (2, 8, 2)
        assert governor_for(None, read_limits=lambda: CpuLimits(EIGHT_CPUS, None, 0.5)) is None
        monkeypatch.undo()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# -- the container's cores, over fake cgroup trees ------------------------------------------


def cgroup_tree(root: Path, proc_self_cgroup: str, files: dict[str, str]) -> Path:
    """A fake / under root: proc/self/cgroup, and `files` relative to sys/fs/cgroup."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_self_cgroup)
    for relative, text in files.items():
        path = root / "sys/fs/cgroup" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def limits_on_eight_cpus(root: Path) -> CpuLimits:
    return read_cpu_limits(root, affinity=lambda: EIGHT_CPUS)


POD = "kubepods.slice/pod1"
V2_CONTAINER = f"0::/{POD}/ctr\n"


def test_v2_fractional_quota_rounds_up(tmp_path) -> None:
    root = cgroup_tree(tmp_path, V2_CONTAINER, {f"{POD}/ctr/cpu.max": "150000 100000"})
    limits = limits_on_eight_cpus(root)
    assert limits == CpuLimits(EIGHT_CPUS, None, 1.5)
    assert limits.cores == 2


def test_v2_no_quota_leaves_the_cpuset_or_the_affinity_mask(tmp_path) -> None:
    root = cgroup_tree(tmp_path, V2_CONTAINER, {f"{POD}/ctr/cpu.max": "max 100000"})
    assert limits_on_eight_cpus(root) == CpuLimits(EIGHT_CPUS, None, None)
    assert limits_on_eight_cpus(root).cores == 8
    assert read_cpu_limits(root, affinity=lambda: {0, 1, 2}).cores == 3
    (root / f"sys/fs/cgroup/{POD}/ctr/cpuset.cpus.effective").write_text("2-5\n")
    assert limits_on_eight_cpus(root).cpuset == {2, 3, 4, 5}
    assert limits_on_eight_cpus(root).cores == 4


def test_v2_cpuset_list_with_a_gap(tmp_path) -> None:
    assert parse_cpu_list("0-1,4\n") == {0, 1, 4}
    assert parse_cpu_list("0-3,8-9,12") == {0, 1, 2, 3, 8, 9, 12}
    assert parse_cpu_list("") == frozenset()
    root = cgroup_tree(tmp_path, V2_CONTAINER, {f"{POD}/ctr/cpuset.cpus.effective": "0-1,4"})
    assert limits_on_eight_cpus(root) == CpuLimits(EIGHT_CPUS, frozenset({0, 1, 4}), None)
    assert limits_on_eight_cpus(root).cores == 3


def test_v2_innermost_cpuset_applies(tmp_path) -> None:
    files = {"kubepods.slice/cpuset.cpus.effective": "0-7", f"{POD}/cpuset.cpus.effective": "6-7"}
    root = cgroup_tree(tmp_path, V2_CONTAINER, files)  # the container's own dir has no file
    assert limits_on_eight_cpus(root).cpuset == {6, 7}


def test_v2_tightest_quota_on_the_path_applies(tmp_path) -> None:
    files = {
        "kubepods.slice/cpu.max": "max 100000",
        f"{POD}/cpu.max": "100000 100000",  # the pod: 1 core
        f"{POD}/ctr/cpu.max": "300000 100000",  # its container asks for 3
    }
    root = cgroup_tree(tmp_path, V2_CONTAINER, files)
    assert limits_on_eight_cpus(root).quota == 1.0
    assert limits_on_eight_cpus(root).cores == 1
    (root / f"sys/fs/cgroup/{POD}/ctr/cpu.max").write_text("50000 200000\n")  # 0.25 core
    assert limits_on_eight_cpus(root).quota == 0.25
    assert limits_on_eight_cpus(root).cores == 1


def test_v1_quota_and_cpuset_files(tmp_path) -> None:
    proc = "5:cpuset:/kubepods/pod1/ctr\n4:cpu,cpuacct:/kubepods/pod1/ctr\n0::/\n"
    files = {
        "cpu,cpuacct/kubepods/pod1/ctr/cpu.cfs_quota_us": "250000",
        "cpu,cpuacct/kubepods/pod1/ctr/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/kubepods/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/kubepods/cpu.cfs_period_us": "100000",
        "cpuset/kubepods/pod1/ctr/cpuset.effective_cpus": "2-7",
    }
    root = cgroup_tree(tmp_path, proc, files)
    assert limits_on_eight_cpus(root) == CpuLimits(EIGHT_CPUS, frozenset(range(2, 8)), 2.5)
    assert limits_on_eight_cpus(root).cores == 3


def test_v1_container_without_a_cgroup_namespace_reads_the_mount_root(tmp_path) -> None:
    # /proc/self/cgroup names the host's path; the container sees its own cgroup at the mount.
    files = {"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"}
    root = cgroup_tree(tmp_path, "3:cpu:/docker/0123abcd\n", files)
    assert limits_on_eight_cpus(root) == CpuLimits(EIGHT_CPUS, None, 2.0)


def test_no_cgroups_leaves_the_affinity_mask(tmp_path) -> None:
    assert limits_on_eight_cpus(tmp_path) == CpuLimits(EIGHT_CPUS, None, None)
    assert limits_on_eight_cpus(tmp_path).cores == 8


# cpuN user nice system idle iowait irq softirq steal guest guest_nice
PROC_STAT = """\
cpu  9999 9999 9999 9999 9999 9999 9999 9999 0 0
cpu0 10 1 2 1000 5 3 4 6 7 8
cpu1 20 0 0 1000 0 0 0 0 0 0
cpu2 100 200 300 4000 50 60 70 80 0 0
intr 123 4 5 6
ctxt 789
"""


def test_proc_stat_sums_only_the_allowed_cpus(tmp_path) -> None:
    # busy = user + nice + system + irq + softirq + steal (guest is inside user already)
    assert busy_ticks(PROC_STAT, {0}) == 10 + 1 + 2 + 3 + 4 + 6
    assert busy_ticks(PROC_STAT, {1}) == 20
    assert busy_ticks(PROC_STAT, {0, 2}) == 26 + 810
    assert busy_ticks(PROC_STAT, {0, 2, 9}) == 836  # an absent (offline) CPU adds nothing
    assert busy_ticks(PROC_STAT, set()) == 0
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/stat").write_text(PROC_STAT)
    times = read_cpu_times(frozenset({0, 2}), root=tmp_path)
    assert times is not None and times.busy == 836 / os.sysconf("SC_CLK_TCK")
    assert read_cpu_times(frozenset({0}), root=tmp_path / "missing") is None
