"""The serving benchmark: exact 128-token prompts, per-level arithmetic, and one short run
of the command against the real server whose last line is the JSON result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from loadtest_server import REPO, Server

from loadtest.serving_bench import (
    BenchConfig,
    build_body,
    build_parser,
    level_result,
    make_prompts,
    response_format,
)
from loadtest.sse import StreamTiming
from loadtest.text import TextSource, load_tokenizer


def test_prompts_are_distinct_and_exactly_128_tokens() -> None:
    source = TextSource(load_tokenizer("default"))
    prompts = make_prompts(source, 64, 128)
    assert len(set(prompts)) == 64
    assert {source.count_tokens(p) for p in prompts} == {128}


def test_body_asks_for_exactly_max_tokens_on_both_endpoints() -> None:
    cfg = BenchConfig(base_url="http://x", model="m", output_tokens=128)
    body = build_body(cfg, "hello")
    assert body["prompt"] == "hello" and body["max_tokens"] == body["n_predict"] == 128
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    chat = build_body(BenchConfig(base_url="http://x", model="m", endpoint="chat"), "hi")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat


def test_greedy_is_the_default_and_sends_no_top_p_or_seed() -> None:
    args = build_parser().parse_args([])
    assert (args.temperature, args.top_p, args.seed) == (0.0, 1.0, None)
    cfg = BenchConfig(base_url="http://x", model="m")
    body = build_body(cfg, "hello", index=5)
    assert body["temperature"] == 0.0 and "top_p" not in body and "seed" not in body
    assert cfg.decoding() == "greedy"


def test_sampled_flags_give_each_request_seed_plus_its_index() -> None:
    args = build_parser().parse_args(["--temperature", "0.8", "--top-p", "0.95", "--seed", "7"])
    assert (args.temperature, args.top_p, args.seed) == (0.8, 0.95, 7)
    cfg = BenchConfig(base_url="http://x", model="m", temperature=0.8, top_p=0.95, seed=7)
    bodies = [build_body(cfg, "hello", index=i) for i in range(3)]
    assert [b["seed"] for b in bodies] == [7, 8, 9]
    assert all(b["temperature"] == 0.8 and b["top_p"] == 0.95 for b in bodies)
    assert build_body(cfg, "hello", index=1) == bodies[1]  # reproducible
    unseeded = build_body(BenchConfig(base_url="http://x", model="m", temperature=0.8), "hi")
    assert "seed" not in unseeded and "top_p" not in unseeded


def finished(sent: float, chunk_times: list[float], tokens: int) -> StreamTiming:
    t = StreamTiming(sent_at=sent)
    for now in chunk_times:
        t.feed('data: {"choices":[{"text":"x"}]}', now)
    t.feed(
        f'data: {{"choices":[],"usage":{{"prompt_tokens":128,"completion_tokens":{tokens}}}}}', 0
    )
    t.feed("data: [DONE]", 0)
    t.finish(chunk_times[-1])
    return t


def test_level_result_arithmetic() -> None:
    cfg = BenchConfig(base_url="http://x", model="m", output_tokens=4)
    ok = finished(0.0, [0.5, 0.6, 0.7, 0.8], 4)
    short = finished(0.0, [1.0, 1.2], 2)
    failed = StreamTiming(sent_at=0.0, error="HTTP 429: full")
    r = level_result(cfg, 2, [ok, short, failed], wall_s=2.0)
    assert (r.requests, r.failed, r.short_completions, r.output_tokens) == (3, 1, 1, 6)
    assert r.output_tokens_per_s == 3.0 and r.mean_prompt_tokens == 128
    assert r.ttft_s["p50"] == pytest.approx(0.75) and r.itl_s["count"] == 4
    assert r.errors == {"stream error: HTTP 429: full": 1}


@pytest.mark.parametrize(
    "decoding", [[], ["--temperature", "0.8", "--top-p", "0.95", "--seed", "3"]]
)
def test_bench_command_against_the_real_server(main_server: Server, decoding: list[str]) -> None:
    command = [sys.executable, "-m", "loadtest.serving_bench", "--base-url",
               main_server.base_url, "--concurrency", "1,2", "--num-requests", "2",
               "--output-tokens", "4", "--label", "meterserve", *decoding]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["label"] == "meterserve" and result["prompt_tokens"] == 128
    assert result["seed"] == (3 if decoding else None)
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["failed"] == 0 and level["short_completions"] == 0
        assert level["output_tokens"] == 4 * level["requests"] == 8
        assert level["mean_prompt_tokens"] == 128  # exact prompts, as the server counted them
        assert level["output_tokens_per_s"] > 0 and level["ttft_s"]["p50"] > 0
        assert level["itl_s"]["count"] > 0


def test_response_format_constrains_every_request_only_when_asked(tmp_path) -> None:
    assert response_format("json_object") == {"type": "json_object"} and not response_format(None)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text('{"type": "object"}')
    assert response_format(str(schema_file)) == {
        "type": "json_schema",
        "json_schema": {"name": "bench", "schema": {"type": "object"}},
    }
    cfg = BenchConfig(base_url="http://x", model="m", response_format={"type": "json_object"})
    constrained = build_body(cfg, "hi")
    assert constrained["response_format"] == {"type": "json_object"}
    assert "ignore_eos" not in constrained  # servers refuse it beside a grammar
    assert "response_format" not in build_body(BenchConfig(base_url="http://x", model="m"), "hi")
