"""`meterserve loadtest`: run locust headless against a server and report what happened.

Runs locust as a subprocess (locust monkey-patches the process with gevent on import, so it
never runs inside this one), bounded by --duration and --max-requests, then writes into --out:
locust's CSV and HTML reports, requests.jsonl (one line per request), summary.json, summary.txt
(the table also printed) and plot.png. Server-side figures (tokens, busy time, cost per 1M
tokens, utilization) come from the server's /metrics scraped before and after the run.

Exit status: 0 when every request succeeded, 1 when some failed (or locust failed), 2 when the
run could not start (server unreachable, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.plot import plot_run
from loadtest.prom import Scrape, scrape
from loadtest.records import read_records
from loadtest.report import Slo, format_table, summarize
from loadtest.server_figures import GENERATION_TOKENS, PROMPT_TOKENS, server_figures
from loadtest.text import default_gguf_path
from loadtest.workload import MODES, build_config

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HOST = "http://127.0.0.1:8000"
STARTUP_ALLOWANCE_S = 90.0  # locust start-up and report writing, on top of run time + stop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meterserve loadtest",
        description="Load-test an OpenAI-compatible server with locust and report latency, "
        "throughput, goodput and the server's own cost per token.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="server base URL")
    p.add_argument("--users", type=int, default=16, help="concurrent users (rate shape: pool)")
    p.add_argument("--spawn-rate", type=float, default=None, help="users/s; default: all at once")
    p.add_argument("--duration", default="60s", help="run time: 90, 90s, 2m, 1m30s")
    p.add_argument("--shape", choices=["steady", "ramp", "rate"], default="steady")
    p.add_argument("--rate", type=float, default=1.0, help="rate shape: sessions per second")
    p.add_argument("--ramp-step-users", type=int, default=4)
    p.add_argument("--ramp-step-seconds", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many")
    p.add_argument("--workload", choices=list(MODES), default="single")
    p.add_argument(
        "--input-tokens",
        default="128",
        help="e.g. 128, uniform,low=32,high=512, "
        "lognormal,median=128,sigma=0.8,max=1024, pareto,scale=32,alpha=1.5,max=2048",
    )
    p.add_argument("--output-tokens", default="32", help="max_tokens per request, same syntax")
    p.add_argument("--shared-prefix-tokens", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument(
        "--mix", default="", help="chat_stream=4,chat=1,completions_stream=2,completions=1"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer",
        default="auto",
        help="auto (the default model's if installed, "
        "else approx) | approx | default | path to .gguf or HF dir",
    )
    p.add_argument("--model", default="", help="default: the first of GET /v1/models")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--api-key", default="")
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        help="seconds; default: the server's meterserve_slo_ttft_seconds, else 2.0",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        default=None,
        help="seconds; default: the server's meterserve_slo_itl_seconds, else 0.25",
    )
    p.add_argument("--slo-e2e", type=float, default=None, help="seconds; default: not judged")
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=60.0,
        help="seconds in-flight requests get to finish when the run ends",
    )
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="report folder; default results/loadtest-<time>")
    p.add_argument("--quiet", action="store_true", help="do not print the table")
    return p


def parse_duration(text: str) -> float:
    """'90' | '90s' | '2m' | '1m30s' | '1h' → seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"bad duration {text!r}; use e.g. 90s, 2m, 1m30s")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        seconds = parse_duration(args.duration)
        build_config(  # validate the workload here, not inside locust
            args.workload, args.seed, args.input_tokens, args.output_tokens, args.mix or None,
            args.shared_prefix_tokens, args.turns,
        )  # fmt: skip
    except ValueError as exc:
        print(f"meterserve loadtest: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        httpx.get(f"{args.host.rstrip('/')}/v1/models", timeout=10, headers=headers)
    except httpx.HTTPError as exc:
        print(f"meterserve loadtest: {args.host} is not reachable: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"results/loadtest-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").unlink(missing_ok=True)
    before = _try_scrape(args.host, headers)
    exit_code = _run_locust(args, seconds, out)
    after = _settled_scrape(args.host, headers, before)
    summary = _summary(args, out, before, after, exit_code)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = format_table(summary)
    (out / "summary.txt").write_text(table + "\n")
    plot_run(read_records(out / "requests.jsonl"), out / "plot.png", title=table.splitlines()[0])
    if not args.quiet:
        print(table)
        print(
            f"\nreports in {out}/ (summary.json, summary.txt, plot.png, report.html, locust_*.csv)"
        )
    return 0 if exit_code == 0 and summary["requests"]["failed"] == 0 else 1


def locust_command(args: argparse.Namespace, seconds: float, out: Path) -> list[str]:
    tokenizer = args.tokenizer
    if tokenizer == "auto":
        tokenizer = "default" if default_gguf_path() is not None else "approx"
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", args.host, "--users", str(args.users),
        "--spawn-rate", str(args.spawn_rate or args.users), "--run-time", f"{seconds:g}s",
        "--stop-timeout", f"{args.stop_timeout:g}", "--csv", str(out / "locust"),
        "--csv-full-history", "--html", str(out / "report.html"), "--only-summary",
        "--shape", args.shape, "--rate", str(args.rate),
        "--ramp-step-users", str(args.ramp_step_users),
        "--ramp-step-seconds", str(args.ramp_step_seconds),
        "--max-requests", str(args.max_requests), "--workload", args.workload,
        "--input-tokens", args.input_tokens, "--output-tokens", args.output_tokens,
        "--seed", str(args.seed), "--tokenizer", tokenizer,
        "--temperature", str(args.temperature), "--request-timeout", str(args.request_timeout),
        "--records-out", str(out / "requests.jsonl"),
    ]  # fmt: skip
    optional = {
        "--mix": args.mix,
        "--model": args.model,
        "--api-key": args.api_key,
        "--shared-prefix-tokens": args.shared_prefix_tokens,
        "--turns": args.turns,
    }
    for flag, value in optional.items():
        if value not in (None, ""):
            command += [flag, str(value)]
    if args.ignore_eos:
        command.append("--ignore-eos")
    return command


def _run_locust(args: argparse.Namespace, seconds: float, out: Path) -> int:
    env = dict(os.environ)
    # The locustfile imports `loadtest.*`; make that work from a source checkout too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    limit = seconds + args.stop_timeout + STARTUP_ALLOWANCE_S
    with (out / "locust.log").open("w") as log:
        process = subprocess.Popen(
            locust_command(args, seconds, out), stdout=log, stderr=subprocess.STDOUT, env=env
        )
        try:
            return process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            process.kill()  # our own child: the run overran every bound it was given
            process.wait()
            log.write(f"\nmeterserve loadtest: locust killed after {limit:.0f} s\n")
            return 124


def _try_scrape(host: str, headers: dict[str, str]) -> Scrape | None:
    try:
        return scrape(host, headers=headers)
    except httpx.HTTPError:
        return None


def _settled_scrape(host: str, headers: dict[str, str], before: Scrape | None) -> Scrape | None:
    """The after-run scrape, taken once the token counters stop moving (the engine thread may
    still be publishing the last step's counts when the last response has arrived)."""
    if before is None:
        return None
    previous = _try_scrape(host, headers)
    for _ in range(20):
        time.sleep(0.25)
        current = _try_scrape(host, headers)
        if current is None or previous is None:
            return current
        if all(current.total(n) == previous.total(n) for n in (PROMPT_TOKENS, GENERATION_TOKENS)):
            return current
        previous = current
    return previous


def _summary(args, out: Path, before: Scrape | None, after: Scrape | None, rc: int) -> dict:
    server = server_figures(before, after) if before and after else None
    slo = Slo(
        ttft_s=args.slo_ttft or _gauge(after, "meterserve_slo_ttft_seconds", 2.0),
        tpot_s=args.slo_tpot or _gauge(after, "meterserve_slo_itl_seconds", 0.25),
        e2e_s=args.slo_e2e,
    )
    run = {
        "host": args.host,
        "shape": args.shape,
        "users": args.users,
        "rate": args.rate if args.shape == "rate" else None,
        "duration": args.duration,
        "max_requests": args.max_requests,
        "workload": args.workload,
        "input_tokens": args.input_tokens,
        "output_tokens": args.output_tokens,
        "mix": args.mix or "default",
        "seed": args.seed,
        "locust_exit_code": rc,
    }
    return summarize(read_records(out / "requests.jsonl"), slo, server, run)


def _gauge(scrape_: Scrape | None, name: str, default: float) -> float:
    if scrape_ is None or not scrape_.has(name):
        return default
    return scrape_.total(name)


if __name__ == "__main__":
    sys.exit(main())
