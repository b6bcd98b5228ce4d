"""Shared helpers for the deploy tests: repository paths, kustomize rendering, settings env names.

Docker cannot run on the CI machine (no engine), so these tests check the deploy files
statically and run every tool that can run here: kubectl kustomize, kubernetes-validate,
hadolint, make -n, and the image's HEALTHCHECK command against a local HTTP server.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"

# Every kustomization a user may apply, relative to deploy/k8s.
KUSTOMIZATIONS = ("", "base", "overlays/hpa", "overlays/model-pvc")


def require_file(path: Path) -> Path:
    """Fail (not skip) with the missing path: a deploy file that is absent is a real defect."""
    if not path.exists():
        pytest.fail(f"missing {path.relative_to(REPO)}", pytrace=False)
    return path


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(require_file(path).read_text())


@functools.cache
def _render(kustomization: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl not found: install it (Debian: apt-get install kubectl)", pytrace=False
        )
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"kubectl kustomize {kustomization or '.'} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(kustomization: str) -> list[dict[str, Any]]:
    """The manifests `kubectl apply -k deploy/k8s/<kustomization>` would send (fresh copies)."""
    return yaml.safe_load(yaml.safe_dump(list(_render(kustomization))))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def only(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@functools.cache
def settings_env_names() -> frozenset[str]:
    """METERSERVE_<FLAG> for every flag of `meterserve serve` (server/cli_flags.py)."""
    from server.cli_flags import ENV_PREFIX, build_parser

    return frozenset(
        ENV_PREFIX + action.dest.upper()
        for action in build_parser()._actions  # same walk as apply_env_defaults
        if action.option_strings and action.dest != "help"
    )
