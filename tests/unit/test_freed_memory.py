"""keep_freed_memory: after it, large allocations freed and made again reuse their pages
instead of faulting in fresh ones (engine/freed_memory.py), on the main thread and, with
share_one_arena before it starts, on another thread. Each case runs in its own process: the
settings are process-wide and last."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the settings are glibc's malloc's"
)

# A step's pattern: tensors of `size` MB allocated, written and freed, on the main thread or on
# a new one; prints the page faults of the last 8 of 24 rounds. (Kept, the first rounds still
# take fresh pages: torch's aligned allocations leave holes a little short of the next one
# until enough of them coalesce.)
SCRIPT = """
import resource, sys, threading
import torch
from engine.freed_memory import keep_freed_memory, share_one_arena
mode, size, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "shared":
    assert share_one_arena()
def rounds():
    if mode != "default":
        assert keep_freed_memory()
    for i in range(24):
        if i == 16:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(size * 2**20, dtype=torch.uint8).fill_(1)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if where == "thread":
    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
else:
    rounds()
"""


def faults(mode: str, size_mb: int, where: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(size_mb), where],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[-1])


def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    pages = 8 * 64 * 2**20 // 4096
    assert faults("default", 64, "main") >= pages // 2  # glibc maps and unmaps each tensor
    assert faults("kept", 64, "main") < pages // 50  # freed pages serve the next tensors


def test_a_thread_reuses_large_allocations_only_in_the_shared_arena() -> None:
    """A thread's own arena maps what exceeds its 64 MB heaps afresh whatever mallopt says
    (the server's engine thread allocates such tensors in a prefill step)."""
    pages = 8 * 100 * 2**20 // 4096
    assert faults("kept", 100, "thread") >= pages // 2
    assert faults("shared", 100, "thread") < pages // 50
