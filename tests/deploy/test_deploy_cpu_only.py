"""The deploy files describe the CPU image that exists, never a GPU build or GPU scheduling.

meterserve computes on the CPU only. A CUDA image, `docker run --gpus` or an `nvidia.com/gpu`
limit in these files would promise a GPU path that does not exist: the container would silently
serve from the CPU while holding a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deploy_support import DEPLOY, K8S, REPO, require_file

# A CUDA build or runtime, Docker's GPU flag, the NVIDIA device plugin's resource, and PyTorch's
# CUDA wheel indexes (download.pytorch.org/whl/cu128, ...; the CPU one is /whl/cpu).
GPU_WORDS = re.compile(r"cuda|--gpus|nvidia\.com/gpu|/whl/cu\d", re.IGNORECASE)


def deploy_files() -> list[Path]:
    """Every file that tells a user how to build, run or schedule the image."""
    fixed = [REPO / "Dockerfile", REPO / "Makefile", DEPLOY / "docker-compose.yml"]
    fixed.append(REPO / "docs" / "deploy.md")
    k8s = sorted(p for p in require_file(K8S).rglob("*") if p.is_file())
    assert k8s, "deploy/k8s holds no files"
    return [require_file(p) for p in fixed] + k8s


def gpu_mentions(text: str) -> list[str]:
    """'line N: text' for each line that names a GPU build or GPU scheduling."""
    return [
        f"line {number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), start=1)
        if GPU_WORDS.search(line)
    ]


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_deploy_file_mentions_no_gpu_path(path: Path) -> None:
    mentions = gpu_mentions(path.read_text())
    assert not mentions, f"{path.relative_to(REPO)} advertises a GPU path:\n" + "\n".join(mentions)


def test_gpu_mentions_catches_what_it_should() -> None:
    """The pattern is not vacuous: each way the files used to advertise a GPU is caught."""
    advertised = [
        "docker build -t meterserve:cuda .",
        "  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .",
        "# The CUDA torch wheel bundles the CUDA runtime",
        "docker run --rm --gpus all -p 8000:8000 meterserve",
        "resources: {limits: {nvidia.com/gpu: 1}}",
        "NVIDIA.COM/GPU",
    ]
    for line in advertised:
        assert gpu_mentions(line) == [f"line 1: {line.strip()}"], line
    cpu_only = "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\nA GPU is not used."
    assert gpu_mentions(cpu_only) == []
