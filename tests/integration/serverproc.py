"""Helpers for the integration tests: `meterserve serve` subprocesses on 127.0.0.1.

Each server runs the real default model (the embedded SmolLM2-135M GGUF) on a free port and is
shared per session or module, because loading a model takes seconds. Tests talk to it over
real HTTP with the official `openai` client or httpx, and read /debug/engine to check that
the block pool leaked nothing.
"""

from __future__ import annotations

import asyncio
import time

import httpx

API_KEY = "sk-meterserve-test"
# <jupyter_code>: a special token no chat prompt or normal completion contains. A step holding
# it fails inside the model runner (EngineConfig.debug_fault_token_id).
FAULT_TOKEN_ID = 13

# test_overload.py's server: one request at a time, at most two queued, requests time out.
OVERLOAD_TIMEOUT_S = 12
OVERLOAD_ARGS = ["--max-num-seqs", "1", "--max-waiting-requests", "2", "--request-timeout",
                 str(OVERLOAD_TIMEOUT_S), "--drain-grace-period", "2"]  # fmt: skip
# test_speculative_decoding.py's server: n-gram speculative decoding.
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# The embedded model drafting for itself: the draft-model path end to end (its drafts are
# nearly all accepted), not a pair that would be faster.
DRAFT_MODEL_SPEC = {"model": "default", "num_speculative_tokens": 3}


async def engine_info(http: httpx.AsyncClient) -> dict:
    response = await http.get("/debug/engine")
    response.raise_for_status()
    return response.json()


async def wait_idle(http: httpx.AsyncClient, timeout: float = 30.0) -> dict:
    """Poll /debug/engine until nothing is in flight; return the idle snapshot."""
    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        info = await engine_info(http)
        busy = info["num_running"] + info["num_waiting"] + info["num_in_flight_http_requests"]
        if busy == 0:
            return info
        await asyncio.sleep(0.1)
    raise AssertionError(f"engine still busy after {timeout} s: {info}")


def assert_no_leaked_blocks(info: dict) -> None:
    assert info["invariants_ok"], info["invariants_error"]
    assert info["num_free_blocks"] == info["num_blocks"], info
    assert info["num_queued"] == 0 and info["queued_tokens"] == 0, info


async def metric_value(http: httpx.AsyncClient, name: str, **labels: str) -> float:
    """One sample's value from /metrics (0.0 when absent)."""
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
