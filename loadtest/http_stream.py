"""One streamed POST with httpx, timed chunk by chunk (loadtest/sse.py's StreamTiming): what the
serving and speculative-decoding benchmarks send."""

from __future__ import annotations

import time

import httpx

from loadtest.sse import StreamTiming, error_message


async def timed_stream(client: httpx.AsyncClient, path: str, body: dict) -> StreamTiming:
    """POST body to path as a stream; a non-200 answer or a transport error is the timing's
    error, never an exception."""
    timing = StreamTiming(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                timing.error = (
                    f"HTTP {response.status_code}: {error_message(await response.aread())}"
                )
                return timing
            async for line in response.aiter_lines():
                timing.feed(line, time.perf_counter())
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        timing.finish(time.perf_counter())
    return timing
