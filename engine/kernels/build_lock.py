"""One kernel build at a time per build directory, safe against a builder that died.

torch's cpp_extension.load guards a build with a FileBaton: a `lock` file that the builder
deletes when it is done, and that every other process waits on, forever, while it exists. A
process killed mid-build (a server stopped during its first start, a pod evicted) leaves that
file behind, and every later start then hangs before serving. build_lock() takes an flock on
`build.flock` in the same directory first: the kernel releases an flock when its holder exits,
however it exits, so the holder knows no live process is building there, and a baton it finds
is stale and is removed before torch looks for it. Concurrent starts still wait for one build.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

FLOCK_NAME = "build.flock"
TORCH_BATON_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build directory's flock; remove a baton left by a builder that died."""
    with open(Path(build_dir) / FLOCK_NAME, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while a live process builds here
        try:
            baton = Path(build_dir) / TORCH_BATON_NAME
            if baton.exists():
                log.warning("removing %s, left by a kernel build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
