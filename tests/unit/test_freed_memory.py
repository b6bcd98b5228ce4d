"""keep_freed_memory: after it, a large allocation freed and made again reuses its pages
instead of faulting in fresh ones (engine/freed_memory.py). Each case runs in its own process:
the setting is process-wide and lasts."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the setting is glibc's malloc's"
)

# A step's pattern: 64 MB tensors allocated, written and freed; prints the page faults of
# the last 8 of 24 rounds. (Kept, the first rounds still take fresh pages: torch's aligned
# allocations leave holes a little short of the next one until enough of them coalesce.)
SCRIPT = """
import resource, sys
import torch
from engine.freed_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def fill():
    torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
for _ in range(16):
    fill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    fill()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    pages = 8 * 64 * 2**20 // 4096
    assert faults("default") >= pages // 2  # glibc maps and unmaps each 64 MB tensor
    assert faults("keep") < pages // 50  # freed pages serve the next tensors
