"""Locust users for an OpenAI-compatible server: /v1/chat/completions and /v1/completions,
streaming and not, in the mix and workload given on the command line (or LOCUST_* env vars).

Locust's own timer stops at the response headers for a stream, so streaming requests also fire
custom request events (request_type TTFT, ITL per chunk gap, TPOT, E2E) and every request is
appended to --records-out as a JSON line (loadtest/records.py), from which the runner computes
its summary. Output tokens come from `usage` (stream_options.include_usage). A non-2xx response
is a failure whose message starts with "HTTP <status>".

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 16 -r 16 -t 20s
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import gevent
import locust.stats
import requests
from locust import HttpUser, events, task
from locust.env import Environment
from locust.exception import StopUser

from loadtest.records import RecordWriter, RequestRecord, set_usage
from loadtest.schedule import PoissonArrivals
from loadtest.shapes import SelectedShape  # noqa: F401  (locust uses the shape it finds here)
from loadtest.sse import StreamTiming, error_message
from loadtest.text import TextSource, load_tokenizer
from loadtest.workload import MODES, Session, Workload, build_config

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
LABELS = {
    "chat_stream": "chat stream",
    "chat": "chat",
    "completions_stream": "completions stream",
    "completions": "completions",
}


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    def add(name: str, **kwargs) -> None:
        env = "LOCUST_" + name.lstrip("-").replace("-", "_").upper()
        parser.add_argument(name, env_var=env, **kwargs)

    add("--model", default="", help="model name to send; empty: the first of GET /v1/models")
    add("--workload", default="single", choices=list(MODES), help="session kind")
    add("--input-tokens", default="128", help="user message length: 128 | uniform,low=..,high=..")
    add("--output-tokens", default="32", help="max_tokens per request, same syntax")
    add("--shared-prefix-tokens", type=int, default=None, help="shared system prompt length")
    add("--turns", type=int, default=None, help="user turns per session")
    add("--mix", default="", help="endpoint weights: chat_stream=4,chat=1,completions_stream=2,...")
    add("--seed", type=int, default=0, help="workload seed")
    add("--tokenizer", default="approx", help="approx | default | path to .gguf or HF dir")
    add("--temperature", type=float, default=0.0)
    add("--ignore-eos", action="store_true", default=False, help="generate exactly max_tokens")
    add("--shape", default="steady", choices=["steady", "ramp", "rate"])
    add("--rate", type=float, default=1.0, help="rate shape: sessions per second, all users")
    add("--ramp-step-users", type=int, default=4)
    add("--ramp-step-seconds", type=float, default=10.0)
    add("--max-requests", type=int, default=0, help="stop the run after this many requests")
    add("--records-out", default="", help="append one JSON line per request to this file")
    add("--api-key", default="", help="sent as Authorization: Bearer")
    add("--request-timeout", type=float, default=300.0)


@dataclass(slots=True)
class RunState:
    """Shared by all users of this locust process (attached to the Environment)."""

    workload: Workload
    model: str
    writer: RecordWriter | None
    max_requests: int
    session_ids: itertools.count = field(default_factory=itertools.count)
    num_sent: int = 0
    stopping: bool = False

    def admit(self) -> bool:
        """Count one more request, or say the request cap is reached."""
        if self.max_requests and self.num_sent >= self.max_requests:
            return False
        self.num_sent += 1
        return True


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_kwargs) -> None:
    opts = environment.parsed_options
    config = build_config(
        mode=opts.workload,
        seed=opts.seed,
        input_tokens=opts.input_tokens,
        output_tokens=opts.output_tokens,
        mix=opts.mix or None,
        shared_prefix_tokens=opts.shared_prefix_tokens,
        num_turns=opts.turns,
    )
    source = TextSource(load_tokenizer(opts.tokenizer))
    environment.meterserve = RunState(
        workload=Workload(config, source),
        model=opts.model or _first_model(environment.host, opts.api_key),
        writer=RecordWriter(Path(opts.records_out)) if opts.records_out else None,
        max_requests=opts.max_requests,
    )


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kwargs) -> None:
    state: RunState | None = getattr(environment, "meterserve", None)
    if state is not None and state.writer is not None:
        state.writer.close()
        state.writer = None


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_kwargs) -> None:
    # Locust rewrites its CSV files once a second and only closes them at exit, so requests
    # that ended in the last second would be missing; one more writer cycle includes them.
    if getattr(environment.parsed_options, "csv_prefix", None):
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.2)


def _first_model(host: str, api_key: str) -> str:
    response = requests.get(f"{host.rstrip('/')}/v1/models", headers=_headers(api_key), timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class OpenAIUser(HttpUser):
    """Runs whole sessions back to back (closed loop), or paced as Poisson arrivals when the
    shape is `rate`. A multi-turn session sends the server's replies back as history."""

    arrivals: PoissonArrivals | None = None

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        if opts.shape == "rate":
            rate_per_user = opts.rate / max(1, opts.num_users)
            rng = random.Random(f"{opts.seed}/arrivals/{id(self)}")
            self.arrivals = PoissonArrivals(rate_per_user, rng, start=time.monotonic())
            gevent.sleep(self.arrivals.delay(time.monotonic()))

    def wait_time(self) -> float:
        return self.arrivals.delay(time.monotonic()) if self.arrivals else 0.0

    @task
    def run_session(self) -> None:
        state: RunState = self.environment.meterserve
        session = state.workload.session(next(state.session_ids))
        replies: list[str] = []
        for turn in range(session.num_turns):
            if not state.admit():
                self._stop_run(state)
            record = self._send(state, session, turn, replies)
            if state.writer is not None:
                state.writer.write(record)
            if not record.ok:
                return

    def _stop_run(self, state: RunState) -> None:
        if not state.stopping:
            state.stopping = True  # one quit for the whole run; in-flight users finish
            gevent.spawn(self.environment.runner.quit)
        raise StopUser()

    def _send(
        self, state: RunState, session: Session, turn: int, replies: list[str]
    ) -> RequestRecord:
        opts = self.environment.parsed_options
        body: dict = {
            "model": state.model,
            "max_tokens": session.turns[turn].max_tokens,
            "temperature": opts.temperature,
            "stream": session.stream,
        }
        if session.is_chat:
            body["messages"] = session.messages(turn, replies)
        else:
            body["prompt"] = session.prompt(turn, replies)
        if session.stream:
            body["stream_options"] = {"include_usage": True}
        if opts.ignore_eos:
            body["ignore_eos"] = True
        record = RequestRecord(
            started_at=time.time(),
            endpoint=session.endpoint,
            session=session.index,
            turn=turn,
            status=0,
            error=None,
            e2e_s=None,
        )
        send = self._stream if session.stream else self._plain
        reply = send(session, body, record)
        if record.ok:
            replies.append(reply)
        return record

    def _post(self, session: Session, body: dict):
        opts = self.environment.parsed_options
        return self.client.post(
            PATHS["chat" if session.is_chat else "completions"],
            json=body,
            headers=_headers(opts.api_key),
            name=LABELS[session.endpoint],
            stream=session.stream,
            catch_response=True,
            timeout=opts.request_timeout,
        )

    def _plain(self, session: Session, body: dict, record: RequestRecord) -> str:
        sent_at = time.perf_counter()
        with self._post(session, body) as response:
            record.e2e_s = time.perf_counter() - sent_at
            record.status = response.status_code
            if not _check_status(response, record):
                return ""
            try:
                payload = response.json()
            except ValueError:
                record.error = f"malformed JSON body: {response.text[:200]!r}"
                response.failure(record.error)
                return ""
            response.success()
        set_usage(record, payload.get("usage"))
        self._fire("E2E", session, record.e2e_s, record.completion_tokens)
        choice = payload["choices"][0]
        return choice["message"]["content"] if session.is_chat else choice["text"]

    def _stream(self, session: Session, body: dict, record: RequestRecord) -> str:
        timing = StreamTiming(sent_at=time.perf_counter())
        with self._post(session, body) as response:
            record.status = response.status_code
            if not _check_status(response, record):
                return ""
            try:
                for line in response.iter_lines(chunk_size=None):
                    timing.feed(line, time.perf_counter())
            except (requests.RequestException, OSError) as exc:  # dropped mid-stream: a failure
                timing.error = f"{type(exc).__name__}: {exc}"
            timing.finish(time.perf_counter())
            record.error = timing.failure()
            if record.error:
                response.failure(record.error)
                return ""
            response.success()
        set_usage(record, timing.usage)
        record.ttft_s, record.tpot_s, record.e2e_s = timing.ttft, timing.tpot, timing.e2e
        record.itl_s = [round(gap, 6) for gap in timing.gaps]
        self._fire("TTFT", session, record.ttft_s)
        for gap in timing.gaps:
            self._fire("ITL", session, gap)
        self._fire("TPOT", session, record.tpot_s)
        self._fire("E2E", session, record.e2e_s, record.completion_tokens)
        return "".join(timing.text)

    def _fire(self, kind: str, session: Session, seconds: float | None, length: int = 0) -> None:
        if seconds is None:
            return
        self.environment.events.request.fire(
            request_type=kind,
            name=LABELS[session.endpoint],
            response_time=seconds * 1000.0,
            response_length=length,
            exception=None,
            context={},
        )


def _check_status(response, record: RequestRecord) -> bool:
    """Mark a non-2xx response (or no response: status 0) as this request's failure."""
    if 200 <= response.status_code < 300:
        return True
    reason = error_message(response.content or b"") if response.content else str(response.error)
    record.error = f"HTTP {response.status_code}: {reason}"
    response.failure(record.error)
    return False
