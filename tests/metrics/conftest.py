"""Fixtures of the metrics tests: the real Prometheus binaries, or a clear failure."""

from __future__ import annotations

import shutil

import pytest


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} not found on PATH: the metrics tests need a real Prometheus. "
            "Install it with `make prometheus` (apt-get install -y prometheus)."
        )
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _binary("prometheus")
