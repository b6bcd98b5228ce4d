"""ThreadGovernor on a fake clock and fake CPU counters: the thread count follows the cores
other processes leave free, changes only after two windows agree, and a fixed count turns it
off. Real /proc/stat is read once, for its shape."""

from __future__ import annotations

import pytest

from engine.thread_governor import (
    CpuTimes,
    ThreadGovernor,
    governor_for,
    read_cpu_times,
    threads_for,
)


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


def _governor(machine: FakeMachine, cores: int = 2) -> ThreadGovernor:
    return ThreadGovernor(
        cores, window_s=0.5, read=machine.read, set_threads=machine.calls.append,
        clock=lambda: machine.now,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cores", "others", "threads"),
    [(2, 0.0, 2), (2, 0.3, 2), (2, 0.7, 1), (2, 1.0, 1), (2, 2.0, 1), (8, 2.2, 6), (8, 0.4, 8)],
)
def test_threads_are_the_cores_others_leave(cores, others, threads) -> None:
    assert threads_for(cores, others) == threads


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


def test_a_fixed_thread_count_turns_the_governor_off(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert governor_for(num_threads=2) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert governor_for(num_threads=None) is None


def test_proc_stat_reads_as_cpu_seconds() -> None:
    first = read_cpu_times()
    if first is None:
        pytest.skip("no /proc/stat here")
    second = first
    for _ in range(200):  # CPU time of our own, at least one clock tick of it
        sum(i * i for i in range(100_000))
        second = read_cpu_times()
        if second.own > first.own:
            break
    assert second.own > first.own  # the two clocks tick apart: only their direction is certain
    assert second.machine_busy >= first.machine_busy
