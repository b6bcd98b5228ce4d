"""The benchmark report command: its table, its README block, and a smoke run against the real
server (tiny requests; no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace

import pytest
from loadtest_server import REPO, Server

from loadtest.bench_report import README_END, README_START, Run, markdown, replace_block
from loadtest.serving_bench import LevelResult


def _level(concurrency: int, rate: float, ttft_s: float, failed: int = 0) -> LevelResult:
    return LevelResult(concurrency, 8, failed, 1.0, int(rate), rate, 0, 128.0,
                       ttft_s={"p50": ttft_s})  # fmt: skip


def test_markdown_puts_both_servers_and_their_ratio_on_one_row() -> None:
    args = Namespace(model="default", prompt_tokens=128, output_tokens=128)
    ours = Run("meterserve", "0.1", [_level(1, 90.0, 0.05), _level(64, 1300.0, 2.0, failed=1)])
    peer = Run("vLLM CPU", "0.32.0", [_level(1, 45.0, 0.1), _level(64, 650.0, 4.0)])
    text = markdown(ours, peer, args, "2026-12-02 07:00 UTC")
    assert "2026-12-02 07:00 UTC" in text and "vLLM CPU 0.32.0" in text and "cores" in text
    assert "| 1 | 90.0 | 50 | 45.0 | 100 | 2.00× |" in text
    assert "| 64 | 1300.0 (1 failed) | 2000 | 650.0 | 4000 | 2.00× |" in text
    alone = markdown(ours, None, args, "today")
    assert "no peer run" in alone and "| 1 | 90.0 | 50 |" in alone and "×" not in alone


def test_replace_block_rewrites_only_between_the_markers() -> None:
    readme = f"intro\n{README_START}\nold table\n{README_END}\nrest\n"
    assert replace_block(readme, "new\n") == f"intro\n{README_START}\nnew\n{README_END}\nrest\n"
    with pytest.raises(ValueError, match="bench-report"):
        replace_block("no markers", "new\n")


def test_smoke_run_against_the_real_server_writes_the_report(main_server: Server, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{README_START}\nstale\n{README_END}\nb\n")
    out = tmp_path / "report.md"
    command = [sys.executable, "-m", "loadtest.bench_report", "--smoke", "--meterserve-url",
               main_server.base_url, "--out", str(out), "--readme", str(readme)]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = out.read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "clients" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
    assert "failed" not in report and "16-token prompts" in report
    assert readme.read_text() == f"a\n{README_START}\n{report}{README_END}\nb\n"
