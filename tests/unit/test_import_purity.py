"""scheduler/ and kvcache/ are plain Python: importing all of them loads no torch, no web
framework, no Prometheus client (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, json, pkgutil, sys
imported = []
for package_name in ("scheduler", "kvcache"):
    package = importlib.import_module(package_name)
    imported.append(package_name)
    for module in pkgutil.walk_packages(package.__path__, package_name + "."):
        importlib.import_module(module.name)
        imported.append(module.name)
heavy = sorted(name for name in ("torch", "fastapi", "prometheus_client") if name in sys.modules)
print(json.dumps({"imported": imported, "heavy": heavy}))
"""


def test_scheduler_and_kvcache_import_without_heavy_dependencies() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    for module in (
        "scheduler.scheduler",
        "scheduler.request",
        "kvcache.kv_cache_manager",
        "kvcache.block_pool",
    ):
        assert module in report["imported"]
