"""Summary of one load-test run: from the per-request records (client side) and the server's
/metrics deltas (server side), as a JSON-able dict and a readable table. No locust import.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from loadtest.records import RequestRecord
from loadtest.server_figures import ServerFigures
from loadtest.stats import Distribution


@dataclass(frozen=True, slots=True)
class Slo:
    """A request meets the SLO when it succeeded and every target holds.

    A stream is judged on its TTFT and TPOT. A non-streamed request shows its client nothing
    until it ends, so it is judged on e2e ≤ ttft_s + tpot_s × (completion_tokens − 1): the
    time a stream of the same length that just met both targets would take. The e2e target,
    when set, applies to every request.
    """

    ttft_s: float = 2.0
    tpot_s: float = 0.25
    e2e_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.e2e_s is None:
            return False
        if self.e2e_s is not None and r.e2e_s > self.e2e_s:
            return False
        if not r.stream:
            allowed = self.ttft_s + self.tpot_s * max(0, r.completion_tokens - 1)
            return r.e2e_s <= allowed
        if r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        return r.tpot_s is None or r.tpot_s <= self.tpot_s


def summarize(
    records: list[RequestRecord],
    slo: Slo,
    server: ServerFigures | None,
    run: dict,
) -> dict:
    """The summary.json object. `run` describes the configuration (echoed as is)."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    window = _window(records)
    good = [r for r in ok if slo.met(r)]
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    summary: dict = {
        "run": run,
        "window_s": window,
        "requests": {
            "total": len(records),
            "succeeded": len(ok),
            "failed": len(failed),
            "failures_by_status": _count(str(r.status) for r in failed),
            "failures_by_error": dict(Counter(r.error for r in failed).most_common(10)),
            "by_endpoint": _count(r.endpoint for r in records),
        },
        "tokens": {
            "prompt": prompt,
            "completion": completion,
            "cached_prompt": sum(r.cached_tokens for r in ok),
        },
        "throughput": {
            "requests_per_s": _rate(len(ok), window),
            "output_tokens_per_s": _rate(completion, window),
            "total_tokens_per_s": _rate(prompt + completion, window),
        },
        "latency_s": {
            "ttft": Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]).to_dict(),
            "itl": Distribution.of([gap for r in ok for gap in r.itl_s]).to_dict(),
            "tpot": Distribution.of([r.tpot_s for r in ok if r.tpot_s is not None]).to_dict(),
            "e2e": Distribution.of([r.e2e_s for r in ok if r.e2e_s is not None]).to_dict(),
        },
        "goodput": {
            "slo": asdict(slo),
            "requests": len(good),
            "ratio": len(good) / len(records) if records else None,
            "requests_per_s": _rate(len(good), window),
            "output_tokens_per_s": _rate(sum(r.completion_tokens for r in good), window),
        },
        "server": server.to_dict() if server else None,
    }
    if server is not None:
        summary["tokens_match_server"] = {
            "prompt": prompt == server.prompt_tokens,
            "completion": completion == server.generation_tokens,
        }
    return summary


def _window(records: list[RequestRecord]) -> float:
    """Seconds from the first request sent to the last response ended."""
    if not records:
        return 0.0
    start = min(r.started_at for r in records)
    end = max(r.started_at + (r.e2e_s or 0.0) for r in records)
    return max(end - start, 1e-9)


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def _count(keys) -> dict[str, int]:
    return dict(sorted(Counter(keys).items()))


# ---- the readable table ---------------------------------------------------------------------


def format_table(summary: dict) -> str:
    run, req, tput = summary["run"], summary["requests"], summary["throughput"]
    lines = [
        (
            f"load test: {run.get('host')}  shape={run.get('shape')}  users={run.get('users')}  "
            f"duration={run.get('duration')}  workload={run.get('workload')}"
        ),
        f"requests    {req['total']} sent, {req['succeeded']} ok, {req['failed']} failed"
        + (f"  by status {req['failures_by_status']}" if req["failed"] else ""),
        (
            f"tokens      {summary['tokens']['prompt']} prompt, {summary['tokens']['completion']} "
            f"output, {summary['tokens']['cached_prompt']} cached prompt"
        ),
        (
            f"throughput  {tput['requests_per_s']:.2f} req/s, {tput['output_tokens_per_s']:.1f} "
            f"output tok/s, {tput['total_tokens_per_s']:.1f} total tok/s "
            f"over {summary['window_s']:.1f} s"
        ),
        "",
        f"{'latency (ms)':<14}{'p50':>9}{'p90':>9}{'p99':>9}{'mean':>9}{'count':>8}",
    ]
    for name, dist in summary["latency_s"].items():
        cells = [_ms(dist[k]) for k in ("p50", "p90", "p99", "mean")]
        lines.append(
            f"  {name.upper():<12}" + "".join(f"{c:>9}" for c in cells) + f"{dist['count']:>8}"
        )
    good, slo = summary["goodput"], summary["goodput"]["slo"]
    targets = f"TTFT ≤ {slo['ttft_s'] * 1e3:.0f} ms, TPOT ≤ {slo['tpot_s'] * 1e3:.0f} ms" + (
        f", e2e ≤ {slo['e2e_s']:.1f} s" if slo["e2e_s"] else ""
    )
    ratio = "n/a" if good["ratio"] is None else f"{good['ratio']:.1%}"
    lines += [
        "",
        (
            f"goodput     {good['requests']} requests met the SLO ({targets}): {ratio}, "
            f"{good['requests_per_s']:.2f} req/s, {good['output_tokens_per_s']:.1f} output tok/s"
        ),
    ]
    lines += _server_lines(summary)
    return "\n".join(lines)


def _server_lines(summary: dict) -> list[str]:
    s = summary["server"]
    if s is None:
        return ["server      no meterserve metrics at /metrics"]
    match = summary["tokens_match_server"]
    busy = s["busy_prefill_s"] + s["busy_decode_s"]
    prompt_ok, output_ok = _yes(match["prompt"]), _yes(match["completion"])
    return [
        "",
        (
            f"server      {s['prompt_tokens']} prompt + {s['generation_tokens']} generated tokens "
            f"(client counts match: prompt {prompt_ok}, output {output_ok})"
            f"; requests {s['requests_by_reason']}; rejections {s['rejections_by_reason'] or 0}"
        ),
        (
            f"  busy      {busy:.1f} s of {s['wall_s']:.1f} s wall "
            f"(utilization {s['utilization']:.0%}; "
            f"prefill {s['busy_prefill_s']:.1f} s, decode {s['busy_decode_s']:.1f} s); "
            f"mean batch {_num(s['mean_batch_size'], '.1f')} of {s['max_num_seqs']}; "
            f"MFU {_pct(s['mfu'])}, MBU {_pct(s['mbu'])}"
        ),
        (
            f"  cost      ${_num(s['cost_per_1m_tokens_usage'], '.4f')} per 1M tokens usage basis, "
            f"${_num(s['cost_per_1m_tokens_allocation'], '.4f')} allocation basis "
            f"(hardware ${s['hardware_price_per_hour']:.4f}/h); per 1M output tokens "
            f"${_num(s['cost_per_1m_output_tokens_usage'], '.4f')} usage basis"
        ),
        (
            f"  cache     prefix cache hit {s['prefix_cache_hit_tokens']} of "
            f"{s['prefix_cache_queried_tokens']} queried prompt tokens; "
            f"{s['preemptions']} preemptions; server goodput {s['goodput_requests']} requests"
        ),
    ]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"
