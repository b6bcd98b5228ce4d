"""Benchmark report: meterserve and a peer server measured back to back by one command, written
as the Markdown table the README quotes, with the CPU, the date and the peer's version.

    make bench-report                          # meterserve alone, default model, 1/8/32/64 clients
    python -m loadtest.bench_report --peer-url http://127.0.0.1:8010 --peer-label "vLLM CPU" \\
        --peer-start "bash ../shared/peers/vllm_server.sh start 8010 --max-num-seqs 64" \\
        --peer-stop "bash ../shared/peers/vllm_server.sh stop" --readme README.md

meterserve is started here (`meterserve serve`, the default model unless --model) unless
--meterserve-url names one already running; it is stopped before the peer starts, so the two
never share the CPU. The peer (vLLM's CPU server, llama.cpp's llama-server, ...) is started and
stopped by the shell commands given, or is already running at --peer-url. Both get the same
workload from loadtest.serving_bench: distinct 128-token prompts, exactly 128 streamed output
tokens, greedy, closed loop at each concurrency. --smoke runs a few tiny requests (CI runs it so
the report path stays working; no timing is asserted anywhere).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.serving_bench import BenchConfig, LevelResult, make_prompts, run_bench
from loadtest.text import TextSource, load_tokenizer

README_START = "<!-- bench-report:start -->"
README_END = "<!-- bench-report:end -->"
READY_TIMEOUT_S = 900.0  # vLLM's first start compiles for minutes


@dataclass(frozen=True, slots=True)
class Run:
    """One server's figures from this report."""

    label: str
    version: str
    levels: list[LevelResult]


def cpu_description() -> str:
    """e.g. 'Intel(R) Xeon(R) Processor, 2 cores, AVX512-BF16, AMX' from /proc/cpuinfo."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    features = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))
                if flag in flags]  # fmt: skip
    return ", ".join([name, f"{os.cpu_count()} cores", *(features or ["no AVX512-BF16"])])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    """Until GET /v1/models answers 200 (both meterserve and OpenAI-style peers serve it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server at {base_url} exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server at {base_url} not ready after {timeout:.0f} s")


def server_facts(base_url: str) -> tuple[str, str]:
    """(first model id, version string from GET /version, or 'unknown')."""
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        version = str(httpx.get(base_url + "/version", timeout=10).json()["version"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        version = "unknown"
    return model, version


def measure(label: str, base_url: str, args: argparse.Namespace, prompts: list[str]) -> Run:
    model, version = server_facts(base_url)
    cfg = bench_config(args, base_url, model)
    print(f"{label} ({version}) at {base_url}, model {model}")
    return Run(label, version, asyncio.run(run_bench(cfg, prompts)))


def bench_config(args: argparse.Namespace, base_url: str = "", model: str = "") -> BenchConfig:
    return BenchConfig(
        base_url=base_url,
        model=model,
        concurrency=args.levels,
        num_requests=args.num_requests,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
    )


def run_meterserve(args: argparse.Namespace, prompts: list[str]) -> Run:
    if args.meterserve_url:
        return measure("meterserve", args.meterserve_url.rstrip("/"), args, prompts)
    port = free_port()
    command = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--model", args.model, *args.serve_arg]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, proc, READY_TIMEOUT_S)
        return measure("meterserve", base_url, args, prompts)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_peer(args: argparse.Namespace, prompts: list[str]) -> Run | None:
    if not args.peer_url:
        return None
    if args.peer_start:
        subprocess.run(args.peer_start, shell=True, check=True)
    try:
        wait_ready(args.peer_url.rstrip("/"), None, READY_TIMEOUT_S)
        return measure(args.peer_label, args.peer_url.rstrip("/"), args, prompts)
    finally:
        if args.peer_stop:
            subprocess.run(args.peer_stop, shell=True, check=False)


def markdown(ours: Run, peer: Run | None, args: argparse.Namespace, when: str) -> str:
    """The report: a line saying where and when, then one row per concurrency."""
    lines = [
        f"Measured {when} on {cpu_description()} by `python -m loadtest.bench_report`"
        f" (meterserve {ours.version}, model {args.model}"
        + (f"; {peer.label} {peer.version}" if peer else "; no peer run")
        + f"): streaming /v1/completions, distinct {args.prompt_tokens}-token prompts, exactly"
        f" {args.output_tokens} output tokens, greedy, closed loop.",
        "",
    ]
    head = "| clients | meterserve tok/s | TTFT p50 (ms) |"
    rule = "|---|---|---|"
    if peer:
        head += f" {peer.label} tok/s | TTFT p50 (ms) | ratio |"
        rule += "---|---|---|"
    lines += [head, rule]
    theirs = {level.concurrency: level for level in (peer.levels if peer else [])}
    for level in ours.levels:
        row = f"| {level.concurrency} | {_rate(level)} | {_ms(level)} |"
        other = theirs.get(level.concurrency)
        if other is not None:
            ratio = level.output_tokens_per_s / max(other.output_tokens_per_s, 1e-9)
            row += f" {_rate(other)} | {_ms(other)} | {ratio:.2f}× |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _rate(level: LevelResult) -> str:
    failed = f" ({level.failed} failed)" if level.failed else ""
    return f"{level.output_tokens_per_s:.1f}{failed}"


def _ms(level: LevelResult) -> str:
    p50 = level.ttft_s.get("p50")
    return "-" if p50 is None else f"{p50 * 1e3:.0f}"


def replace_block(text: str, block: str) -> str:
    """`text` with the part between the README markers replaced by `block`."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"no {README_START} ... {README_END} block to replace")
    return text[: start + len(README_START)] + "\n" + block + text[end:]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_report", description=__doc__)
    p.add_argument("--model", default="default", help="what meterserve serves (--model)")
    p.add_argument("--serve-arg", action="append", default=[], help="more `serve` arguments")
    p.add_argument("--meterserve-url", default="", help="an already running meterserve")
    p.add_argument("--peer-url", default="", help="the peer's base URL; none = meterserve only")
    p.add_argument("--peer-label", default="peer")
    p.add_argument("--peer-start", default="", help="shell command that starts the peer")
    p.add_argument("--peer-stop", default="", help="shell command that stops the peer")
    p.add_argument("--levels", default="1,8,32,64", type=_levels)
    p.add_argument("--num-requests", type=int, default=None, help="per level; max(8, 2c)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("docs/bench_report.md"))
    p.add_argument("--readme", type=Path, default=None, help="rewrite its report block too")
    p.add_argument("--smoke", action="store_true", help="tiny run: 1,2 clients, 8 tokens")
    return p


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(part) for part in text.split(",") if part.strip())
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels must be positive integers")
    return levels


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.levels, args.num_requests, args.prompt_tokens, args.output_tokens = (1, 2), 2, 16, 8
    cfg = bench_config(args)
    source = TextSource(load_tokenizer("default"))
    prompts = make_prompts(source, max(cfg.requests_at(c) for c in cfg.concurrency) + 1,
                           cfg.prompt_tokens)  # fmt: skip
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    try:
        ours = run_meterserve(args, prompts)
        peer = run_peer(args, prompts)
    except (RuntimeError, subprocess.CalledProcessError, httpx.HTTPError) as exc:
        print(f"bench_report: {exc}", file=sys.stderr)
        return 1
    report = markdown(ours, peer, args, when)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    if args.readme is not None:
        args.readme.write_text(replace_block(args.readme.read_text(), report))
    print(report, end="")
    failed = [lvl for run in (ours, peer) if run for lvl in run.levels if lvl.failed]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
