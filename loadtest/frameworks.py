"""Agent and app frameworks against any OpenAI-compatible server: the openai SDK (tools, streamed
tool calls, `parse`, json_schema, the Responses API with `responses.stream` and `parse`),
openai-agents (chat completions and Responses models, forced tools, tool loops, output types,
streamed runs), langchain-openai (`bind_tools`, `with_structured_output`) and instructor
(JSON_SCHEMA, TOOLS, JSON, ...), one pass/fail line per case (loadtest/framework_cases/), so
meterserve and a peer serving the same model are measured the same way.

    python3 -m venv /tmp/fw-venv
    /tmp/fw-venv/bin/pip install openai openai-agents langchain-openai instructor httpx pydantic
    /tmp/fw-venv/bin/python -m loadtest.frameworks --base-url http://127.0.0.1:8000/v1 \\
        --label meterserve --json meterserve.json
    /tmp/fw-venv/bin/python -m loadtest.frameworks --compare vllm.json meterserve.json

The frameworks are not meterserve's dependencies and this module imports nothing of meterserve's
server or engine, so it runs from that separate venv. Every request is greedy with at most 200
new tokens; a case that has not finished after --timeout seconds fails (its HTTP clients time
out at the same limit). Without --model, the first id of GET /models is used. --json writes
every case's result, and for a failed case the requests and responses it exchanged (bodies
truncated), to replay with curl. --compare prints two runs side by side and the cases that pass
on one and fail on the other.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

PACKAGES = ("openai", "openai-agents", "langchain-openai", "langchain-core", "instructor",
            "pydantic", "httpx")  # fmt: skip
DETAIL_CHARS = 400


@dataclass(frozen=True, slots=True)
class CaseResult:
    name: str
    passed: bool
    seconds: float
    detail: str  # one line: what the case saw when it passed, the exception when it failed
    exchanges: list[dict[str, Any]] = field(default_factory=list)  # kept for a failed case


@dataclass(frozen=True, slots=True)
class RunConfig:
    base_url: str
    model: str
    api_key: str
    label: str
    timeout_s: float
    selected: tuple[str, ...]  # case names or name prefixes; empty = every case


def one_line(text: str, limit: int = DETAIL_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def describe(exc: BaseException) -> str:
    """`Type: message`, with the first cause's when the framework wrapped one."""
    if isinstance(exc, TimeoutError) and not str(exc):  # asyncio.wait_for's
        return "TimeoutError: the case ran past --timeout"
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    # An HTTP client's status error under the SDK's repeats it, and says nothing more.
    if cause is not None and str(cause) not in text and type(cause) is not httpx.HTTPStatusError:
        text += f" (cause {type(cause).__name__}: {cause})"
    return one_line(text)


def _in_daemon_thread(fn: Callable[[Any], Any], ctx: Any) -> asyncio.Future:
    """Runs a blocking case on a daemon thread: a case that outlives its timeout is abandoned
    (its clients' own timeout ends it) and never keeps the process alive."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled by the timeout
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(ctx), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, reported by the case
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: the case was abandoned long ago
            pass

    threading.Thread(target=target, daemon=True).start()
    return future


async def run_case(name: str, fn: Callable[[Any], Any], config: RunConfig) -> CaseResult:
    from loadtest.framework_cases import CaseContext

    ctx = CaseContext(config.base_url, config.model, config.api_key, config.timeout_s)
    start = time.monotonic()
    try:
        work = fn(ctx) if inspect.iscoroutinefunction(fn) else _in_daemon_thread(fn, ctx)
        detail, passed = one_line(str(await asyncio.wait_for(work, config.timeout_s))), True
    except Exception as exc:  # noqa: BLE001 - any failure of the framework call fails the case
        detail, passed = describe(exc), False
    seconds = round(time.monotonic() - start, 2)
    return CaseResult(name, passed, seconds, detail, [] if passed else list(ctx.exchanges))


def selected_cases(selected: tuple[str, ...]) -> dict[str, Callable[[Any], Any]]:
    from loadtest.framework_cases import CASES

    if not selected:
        return dict(CASES)
    chosen = {n: fn for n, fn in CASES.items() if any(n.startswith(s) for s in selected)}
    if not chosen:
        raise SystemExit(f"no case matches {', '.join(selected)}")
    return chosen


async def run_all(config: RunConfig) -> list[CaseResult]:
    results = []
    for name, fn in selected_cases(config.selected).items():
        result = await run_case(name, fn, config)
        mark = "PASS" if result.passed else "FAIL"
        print(f"{mark} {name:<42} {result.seconds:6.1f}s  {result.detail}", flush=True)
        results.append(result)
    return results


def first_model(base_url: str, api_key: str) -> str:
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=30, trust_env=False) as client:
        response = client.get(f"{base_url.rstrip('/')}/models", headers=headers)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


def versions() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "missing"
    return found


def run_report(config: RunConfig, results: list[CaseResult]) -> dict[str, Any]:
    return {
        "label": config.label,
        "base_url": config.base_url,
        "model": config.model,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "passed": sum(r.passed for r in results),
        "total": len(results),
        "cases": [asdict(r) for r in results],
    }


# --- compare ----------------------------------------------------------------------------------


def load_run(path: str) -> dict[str, Any]:
    run = json.loads(Path(path).read_text())
    run["by_name"] = {case["name"]: case for case in run["cases"]}
    return run


def _mark(case: dict[str, Any] | None) -> str:
    return "-" if case is None else ("pass" if case["passed"] else "FAIL")


def compare(path_a: str, path_b: str) -> str:
    """Side by side, then the cases that pass on one run and fail on the other (with the
    failing run's reason)."""
    a, b = load_run(path_a), load_run(path_b)
    label_a, label_b = a["label"], b["label"]
    names = list(a["by_name"]) + [n for n in b["by_name"] if n not in a["by_name"]]
    width = max(len(n) for n in names) + 2
    lines = [f"{'case':<{width}}{label_a:>12}{label_b:>12}"]
    for name in names:
        case_a, case_b = a["by_name"].get(name), b["by_name"].get(name)
        lines.append(f"{name:<{width}}{_mark(case_a):>12}{_mark(case_b):>12}")
    lines.append(
        f"{'passed':<{width}}{a['passed']:>9}/{a['total']:<2}{b['passed']:>9}/{b['total']:<2}"
    )
    for winner, loser in ((a, b), (b, a)):
        lines += ["", f"{winner['label']} passes, {loser['label']} fails:"]
        flipped = [
            name
            for name in names
            if winner["by_name"].get(name, {}).get("passed")
            and name in loser["by_name"]
            and not loser["by_name"][name]["passed"]
        ]
        lines += [f"  {n}: {loser['by_name'][n]['detail']}" for n in flipped] or ["  (none)"]
    lines += ["", f"{label_a}: {a['model']} at {a['base_url']}, {a['finished']}"]
    lines += [f"{label_b}: {b['model']} at {b['base_url']}, {b['finished']}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.frameworks",
        description="Agent/app framework cases against an OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="ends in /v1")
    p.add_argument("--model", default="", help="default: the first id of GET /models")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--label", default="", help="this run's name in --compare; default: host")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    p.add_argument("--cases", default="", help="comma-separated case names or name prefixes")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    selected = tuple(s.strip() for s in args.cases.split(",") if s.strip())
    if args.list:
        print("\n".join(selected_cases(selected)))
        return 0
    base_url = args.base_url.rstrip("/")
    config = RunConfig(
        base_url=base_url,
        model=args.model or first_model(base_url, args.api_key),
        api_key=args.api_key,
        label=args.label or httpx.URL(base_url).netloc.decode(),
        timeout_s=args.timeout,
        selected=selected,
    )
    print(f"{config.label}: model {config.model} at {base_url}, {versions()}", flush=True)
    results = asyncio.run(run_all(config))
    report = run_report(config, results)
    print(f"passed {report['passed']}/{report['total']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
