"""The speculative-decoding benchmark: the bundled grounded workload, the clients' prompt plan,
the spec-decode counters read from any server's /metrics, the --compare ratios, and one short
run of the command against the real server (plain and with n-gram drafts) whose last line is
the JSON result, its tokens the usage the server returns."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from loadtest_server import REPO, Server

from loadtest.spec_bench import (
    SpecBenchConfig,
    acceptance_rate,
    build_body,
    client_prompts,
    counter_deltas,
    level_result,
    load_workload,
    read_run,
    spec_counters,
    tok_s_ratios,
)
from loadtest.sse import StreamTiming

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}  # fmt: skip


def test_workload_prompts_are_nonempty_user_messages_with_unique_ids() -> None:
    prompts = load_workload()
    assert len(prompts) >= 10
    assert len({p.id for p in prompts}) == len(prompts) and all(p.id for p in prompts)
    for p in prompts:
        assert p.messages and all(m["role"] in ("system", "user") for m in p.messages)
        assert all(m["content"].strip() for m in p.messages)
        assert len(p.messages[-1]["content"].split()) >= 40  # the passage is in the prompt


def test_one_client_sends_the_prompts_in_order() -> None:
    assert client_prompts(12, 1, 6) == [[0, 1, 2, 3, 4, 5]]
    assert client_prompts(3, 1, 5) == [[0, 1, 2, 0, 1]]


def test_clients_start_at_different_offsets_and_share_the_requests() -> None:
    plan = client_prompts(12, 8, 16)
    assert plan == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [0, 1], [2, 3]]
    uneven = client_prompts(12, 4, 10)
    assert [len(p) for p in uneven] == [3, 3, 2, 2] and [p[0] for p in uneven] == [0, 3, 6, 9]


def test_body_streams_with_usage_and_no_ignore_eos() -> None:
    cfg = SpecBenchConfig(base_url="http://x", model="m", max_tokens=16)
    body = build_body(cfg, [{"role": "user", "content": "hi"}])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert "ignore_eos" not in body and "top_p" not in body
    sampled = build_body(SpecBenchConfig(base_url="x", model="m", temperature=0.7, top_p=0.9), [])
    assert (sampled["temperature"], sampled["top_p"]) == (0.7, 0.9)


METRICS = """\
# TYPE meterserve_spec_decode_num_draft_tokens_total counter
meterserve_spec_decode_num_draft_tokens_total{model="a"} 40.0
meterserve_spec_decode_num_accepted_tokens_total{model="a"} 30.0
meterserve_spec_decode_num_drafts_created{model="a"} 1.7e9
meterserve_generation_tokens_total{model="a"} 99.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0
"""


def test_spec_counters_are_every_spec_decode_total_summed_over_series() -> None:
    assert spec_counters(METRICS) == {
        "meterserve_spec_decode_num_accepted_tokens_total": 30.0,
        "meterserve_spec_decode_num_draft_tokens_total": 40.0,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": 5.0,
    }
    before = {"a_spec_decode_num_draft_tokens_total": 10.0}
    after = {"a_spec_decode_num_draft_tokens_total": 50.0, "a_spec_decode_num_accepted_tokens_total": 30.0}  # fmt: skip
    deltas = counter_deltas(before, after)
    assert deltas == {"a_spec_decode_num_draft_tokens_total": 40.0,
                      "a_spec_decode_num_accepted_tokens_total": 30.0}  # fmt: skip
    assert acceptance_rate(deltas) == 0.75
    assert counter_deltas(None, after) == {} and acceptance_rate({}) is None
    assert acceptance_rate({"x_draft_tokens_total": 0.0, "x_accepted_tokens_total": 0.0}) is None


def test_compare_ratios_are_this_run_over_the_other_per_common_level(tmp_path: Path) -> None:
    this = {"levels": [{"clients": 1, "output_tokens_per_s": 60.0},
                       {"clients": 8, "output_tokens_per_s": 300.0}]}  # fmt: skip
    other = {"levels": [{"clients": 1, "output_tokens_per_s": 40.0},
                        {"clients": 8, "output_tokens_per_s": 0.0},
                        {"clients": 32, "output_tokens_per_s": 9.0}]}  # fmt: skip
    assert tok_s_ratios(this, other) == {"1": 1.5, "8": None}
    assert tok_s_ratios(this, {"levels": []}) == {}
    saved = tmp_path / "run.json"
    saved.write_text("table line\n" + json.dumps(other) + "\n")
    assert read_run(saved) == other


def finished(sent: float, first: float, tokens: int) -> StreamTiming:
    t = StreamTiming(sent_at=sent)
    t.feed('data: {"choices":[{"delta":{"content":"x"}}]}', first)
    t.feed(f'data: {{"choices":[],"usage":{{"prompt_tokens":9,"completion_tokens":{tokens}}}}}', 0)
    t.feed("data: [DONE]", 0)
    t.finish(first + 1)
    return t


def test_level_result_arithmetic() -> None:
    done = [("a", finished(0.0, 0.2, 10)), ("b", finished(1.0, 1.4, 30)),
            ("c", StreamTiming(sent_at=0.0, error="HTTP 429: full"))]  # fmt: skip
    r = level_result(2, done, wall_s=4.0, deltas={})
    assert (r.requests, r.failed, r.output_tokens, r.output_tokens_per_s) == (3, 1, 40, 10.0)
    assert r.mean_tokens_per_request == 20.0
    assert r.ttft_mean_s == pytest.approx(0.3) and r.ttft_median_s == pytest.approx(0.3)
    assert [p.completion_tokens for p in r.per_request] == [10, 30, None]
    assert r.errors == {"stream error: HTTP 429: full": 1} and r.acceptance_rate is None


@pytest.fixture(scope="module")
def ngram_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("spec-bench-server")
    server = Server("ngram", ["--speculative-config", json.dumps(SPEC)], log_dir)
    with server.running():
        yield server


def non_streamed_tokens(server: Server, model: str, messages: list[dict]) -> int:
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_bench_command_against_the_real_server(
    request: pytest.FixtureRequest, speculative: bool, tmp_path: Path
) -> None:
    server: Server = request.getfixturevalue("ngram_server" if speculative else "main_server")
    out = tmp_path / "run.json"
    command = [sys.executable, "-m", "loadtest.spec_bench", "--base-url", server.base_url,
               "--clients", "1", "--requests", "2", "--max-tokens", "16", "--label", "meterserve",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert read_run(out) == result
    assert result["label"] == "meterserve" and result["max_tokens"] == 16
    [level] = result["levels"]
    assert (level["clients"], level["requests"], level["failed"]) == (1, 2, 0)
    prompts = load_workload()
    assert [r["id"] for r in level["per_request"]] == [prompts[0].id, prompts[1].id]
    # Tokens counted are the usage the server returns for the same greedy requests.
    usage = [non_streamed_tokens(server, result["model"], p.messages) for p in prompts[:2]]
    assert [r["completion_tokens"] for r in level["per_request"]] == usage
    assert level["output_tokens"] == sum(usage)
    assert level["mean_tokens_per_request"] == sum(usage) / 2
    assert level["output_tokens_per_s"] > 0 and level["ttft_median_s"] > 0
    drafted = level["spec_decode"]["meterserve_spec_decode_num_draft_tokens_total"]
    accepted = level["spec_decode"]["meterserve_spec_decode_num_accepted_tokens_total"]
    if speculative:  # the prompts are copied: n-gram drafts are proposed, some accepted
        assert drafted > 0 and 0 <= accepted <= drafted
        assert level["acceptance_rate"] == pytest.approx(accepted / drafted)
    else:
        assert drafted == accepted == 0 and level["acceptance_rate"] is None
