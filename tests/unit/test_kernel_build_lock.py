"""The kernel build's flock (engine/kernels/build_lock.py): a build killed midway leaves
torch's baton file behind, which used to hang every later start; the flock is released by the
kernel when its holder dies, so the next builder knows the baton is stale and removes it."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap

import pytest

from engine.kernels.build_lock import FLOCK_NAME, TORCH_BATON_NAME, build_lock

HOLDER = textwrap.dedent(
    """
    import sys, time
    from engine.kernels.build_lock import build_lock
    with build_lock(sys.argv[1]):
        open(sys.argv[1] + "/lock", "w").close()  # torch's baton, as a build in progress has
        print("holding", flush=True)
        time.sleep(600)
    """
)


def _flock_is_free(build_dir) -> bool:
    with open(build_dir / FLOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def test_a_baton_left_by_a_dead_build_is_removed(tmp_path) -> None:
    (tmp_path / TORCH_BATON_NAME).touch()
    with build_lock(tmp_path):
        assert not (tmp_path / TORCH_BATON_NAME).exists()
    assert _flock_is_free(tmp_path)


def test_a_killed_builder_releases_the_lock_and_its_baton_is_cleared(tmp_path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert not _flock_is_free(tmp_path)  # a live build: others wait for it
        holder.kill()
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (tmp_path / TORCH_BATON_NAME).exists()  # what torch would wait on forever
    assert _flock_is_free(tmp_path)
    with build_lock(tmp_path):
        assert not (tmp_path / TORCH_BATON_NAME).exists()


@pytest.mark.parametrize("other_file", ["meterserve_cpu_kernels.so", "build.ninja"])
def test_the_build_outputs_are_left_alone(tmp_path, other_file) -> None:
    (tmp_path / other_file).write_text("built")
    with build_lock(tmp_path):
        pass
    assert (tmp_path / other_file).read_text() == "built"
