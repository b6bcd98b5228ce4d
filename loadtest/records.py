"""RequestRecord: what the load generator saw of one request, one JSON line per request.

The locust users append records to requests.jsonl as requests end; the runner's summary and
plot are computed from these lines (exact percentiles, exact token sums), not from locust's
rounded histograms. No locust import here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO


@dataclass(slots=True)
class RequestRecord:
    started_at: float  # unix time the request was sent
    endpoint: str  # chat_stream | chat | completions_stream | completions
    session: int
    turn: int
    status: int  # HTTP status; 0 when no response arrived (connection error)
    error: str | None  # None = success
    e2e_s: float | None
    ttft_s: float | None = None  # streams only
    tpot_s: float | None = None  # streams with ≥ 2 output tokens
    itl_s: list[float] = field(default_factory=list)  # streams: gaps between content chunks
    prompt_tokens: int = 0  # from usage; 0 for failures
    completion_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when reported
    usage: dict | None = None  # the raw usage object, extension fields included

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def stream(self) -> bool:
        return self.endpoint.endswith("_stream")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> RequestRecord:
        return cls(**json.loads(line))


def set_usage(record: RequestRecord, usage: dict | None) -> None:
    """Copy an OpenAI usage object's counts (and the object itself) into the record."""
    if not usage:
        return
    details = usage.get("prompt_tokens_details") or {}
    record.usage = usage
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = int(usage.get("completion_tokens") or 0)
    record.cached_tokens = int(details.get("cached_tokens") or 0)


class RecordWriter:
    """Appends records as JSON lines, flushed per line so a killed run keeps what it measured."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> list[RequestRecord]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [RequestRecord.from_json(line) for line in lines if line.strip()]
