"""Locust runs (headless, as subprocesses of `meterserve loadtest`) against the real server
on the real model: exact token accounting against /metrics, streaming latencies, prefix-cache
hits from the shared-prefix workload, and 429s reported as failures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from loadtest_server import Server

from loadtest.records import read_records
from loadtest.runner import main as loadtest


def run(server: Server, out: Path, *args: str) -> tuple[int, dict]:
    rc = loadtest(["--host", server.base_url, "--out", str(out), "--quiet", *args])
    summary = json.loads((out / "summary.json").read_text())
    return rc, summary


def test_16_users_for_5_s_zero_failures_and_exact_token_counts(
    main_server: Server, tmp_path: Path
) -> None:
    # Nothing asserted grows with the duration (20 s, then 10 s before): the 16 users spawn
    # within the first second (spawn rate = users) and each starts a session at once, the seed-0
    # mix has all four endpoints among sessions 0-7, and --stop-timeout lets every started
    # request end.
    rc, s = run(
        main_server, tmp_path, "--users", "16", "--duration", "5s", "--input-tokens",
        "uniform,low=8,high=32", "--output-tokens", "6", "--ignore-eos", "--stop-timeout", "120",
    )  # fmt: skip
    req, server = s["requests"], s["server"]
    assert rc == 0, (req, (tmp_path / "locust.log").read_text()[-3000:])
    assert req["failed"] == 0 and req["succeeded"] == req["total"] >= 16
    assert set(req["by_endpoint"]) == {"chat_stream", "chat", "completions_stream", "completions"}
    # Every token the server counted, the client saw in usage, and vice versa.
    assert s["tokens"]["prompt"] == server["prompt_tokens"] > 0
    assert s["tokens"]["completion"] == server["generation_tokens"] == 6 * req["succeeded"]
    assert s["tokens_match_server"] == {"prompt": True, "completion": True}
    assert server["requests_by_reason"] == {"length": req["succeeded"]}
    for name in ("ttft", "itl", "tpot", "e2e"):
        dist = s["latency_s"][name]
        assert dist["count"] > 0 and 0 < dist["p50"] <= dist["p90"] <= dist["p99"], name
    assert s["throughput"]["output_tokens_per_s"] > 0
    assert server["busy_prefill_s"] > 0 and server["busy_decode_s"] > 0
    assert server["cost_per_1m_tokens_usage"] > 0
    assert 0 < server["utilization"] <= 1.05
    # locust's own reports carry the custom streaming events
    with open(tmp_path / "locust_stats.csv") as f:
        kinds = {(row["Type"], row["Name"]) for row in csv.DictReader(f)}
    for kind in ("TTFT", "ITL", "TPOT", "E2E"):
        assert (kind, "chat stream") in kinds and (kind, "completions stream") in kinds
    for name in ("report.html", "plot.png", "summary.txt", "locust_stats_history.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert len(read_records(tmp_path / "requests.jsonl")) == req["total"]


def test_shared_prefix_mode_hits_the_prefix_cache(main_server: Server, tmp_path: Path) -> None:
    rc, s = run(
        main_server, tmp_path, "--users", "2", "--duration", "60s", "--max-requests", "6",
        "--workload", "shared-prefix", "--shared-prefix-tokens", "128", "--input-tokens", "8",
        "--output-tokens", "2", "--mix", "chat_stream=1,completions=1", "--tokenizer", "approx",
    )  # fmt: skip
    server, ok = s["server"], s["requests"]["succeeded"]
    assert rc == 0 and ok == s["requests"]["total"] >= 4
    # The shared system prompt (~128 tokens) spans 7-8 full 16-token blocks; every request
    # after the first two (concurrent) ones finds them cached, and the server's counter of
    # cached prompt tokens agrees exactly with the usage the client received.
    assert s["tokens"]["cached_prompt"] == server["cached_prompt_tokens"] >= 112 * (ok - 2)
    # The step-level lookup counter must visibly rise too. (Observed once: one request's
    # lookup missing from meterserve_prefix_cache_{queries,hits}_total, hence the margin.)
    assert server["prefix_cache_hit_tokens"] >= 56 * (ok - 2)


def test_queue_full_429s_are_failures_with_their_status(
    tiny_queue_server: Server, tmp_path: Path
) -> None:
    rc, s = run(
        tiny_queue_server, tmp_path, "--users", "12", "--duration", "30s", "--max-requests",
        "150", "--input-tokens", "64", "--output-tokens", "4", "--tokenizer", "approx",
    )  # fmt: skip
    req = s["requests"]
    assert rc == 1
    assert req["failures_by_status"].get("429", 0) > 0, req
    assert set(req["failures_by_status"]) == {"429"}
    assert all(e.startswith("HTTP 429") for e in req["failures_by_error"])
    assert req["succeeded"] > 0  # the one queue slot still serves requests
    assert s["server"]["rejections_by_reason"], s["server"]
    assert sum(s["server"]["rejections_by_reason"].values()) == req["failures_by_status"]["429"]
    with open(tmp_path / "locust_failures.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all("HTTP 429" in row["Error"] for row in rows), rows  # locust repr()s it
    assert sum(int(row["Occurrences"]) for row in rows) == req["failures_by_status"]["429"]
