"""What one streaming request of a burst saw (bench/burst.py), the one outcome it ends in,
and a burst's summary: counts per outcome, TTFT and time to refusal, drain time. The outcomes,
the classification of a stream that did not run to its end, and the streaming client serve
bench/soak.py too."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from pdserve.bench.serve_metrics import percentile

if TYPE_CHECKING:
    import aiohttp

REFUSAL_STATUSES = (429, 503)


class Outcome(str, Enum):
    COMPLETED = "completed"
    REFUSED = "refused"
    DIED = "died after a token"
    TIMED_OUT = "timed out"
    FAILED = "failed"


class StreamedRequest(Protocol):
    """What `stream_into` fills in and `outcome_unless_ended` reads of a request's record
    (`StreamRecord` here, `SoakRecord` in bench/soak.py); times in seconds from a start."""

    status: int | None  # None: no HTTP answer arrived
    first_token_s: float | None
    end_s: float
    error_event: str
    exception: str  # the connection failed, or was cut mid-stream
    timed_out: bool
    body: str  # the start of a non-200 answer


@dataclass
class StreamRecord:
    """What one request saw; times in seconds from the burst start."""

    sent_s: float = 0.0
    written_s: float | None = None  # the whole request was on the wire
    status: int | None = None  # None: no HTTP answer arrived
    first_token_s: float | None = None  # the first streamed choice
    end_s: float = 0.0
    text_chunks: int = 0
    usage_tokens: int | None = None
    finish_reason: str | None = None
    error_event: str = ""
    exception: str = ""  # the connection failed, or was cut mid-stream
    timed_out: bool = False
    body: str = ""  # the start of a non-200 answer

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.text_chunks


def absorb_event(record: StreamRecord, data: str, now_s: float) -> None:
    """One SSE `data:` payload of a /v1/completions stream."""
    if data == "[DONE]":
        return
    chunk = json.loads(data)
    error = chunk.get("error")
    if error:
        message = error.get("message", error) if isinstance(error, dict) else error
        record.error_event = str(message)[:200]
        return
    choices = chunk.get("choices")
    if choices:
        if record.first_token_s is None:
            record.first_token_s = now_s
        if choices[0].get("text"):
            record.text_chunks += 1
        record.finish_reason = choices[0].get("finish_reason") or record.finish_reason
    usage = chunk.get("usage")
    if usage:
        record.usage_tokens = usage.get("completion_tokens")


def outcome_unless_ended(record: StreamedRequest, sent: str) -> tuple[Outcome, str] | None:
    """The outcome of a request that did not time out, and what ended it, where it got no 200
    stream that sent a token, or where that stream died after `sent` ("a token", "3 tokens");
    None where the stream ran to its end: whether it is complete is the caller's to judge."""
    if record.status is None:
        return Outcome.FAILED, f"no answer: {record.exception}"
    if record.status in REFUSAL_STATUSES:
        return Outcome.REFUSED, f"HTTP {record.status}"
    if record.status != 200:
        return Outcome.FAILED, f"HTTP {record.status}: {record.body}"
    if record.first_token_s is None:
        if record.error_event:
            return Outcome.REFUSED, "error event"
        if record.exception:
            return Outcome.FAILED, f"the stream broke before a token: {record.exception}"
        return Outcome.FAILED, "the stream ended without a token"
    if record.error_event:
        return Outcome.DIED, f"error event after {sent}: {record.error_event}"
    if record.exception:
        return Outcome.DIED, f"the stream broke after {sent}: {record.exception}"
    return None


def classify(record: StreamRecord, expected_tokens: int) -> tuple[Outcome, str]:
    """The request's one outcome and what, if not completed, ended it."""
    tokens = record.tokens
    if record.timed_out:
        return Outcome.TIMED_OUT, f"after {tokens} tokens"
    if (cut_short := outcome_unless_ended(record, f"{tokens} tokens")) is not None:
        return cut_short
    if record.finish_reason is None:
        return Outcome.DIED, f"{tokens} of {expected_tokens} tokens and no finish_reason"
    if tokens != expected_tokens:
        return Outcome.FAILED, f"finish_reason {record.finish_reason!r} after {tokens} tokens"
    return Outcome.COMPLETED, ""


def summarize(records: list[StreamRecord], expected_tokens: int) -> dict:
    """Counts per outcome (they add up to the requests), refusals by kind, latencies."""
    classified = [(record, *classify(record, expected_tokens)) for record in records]
    counts = Counter(outcome for _, outcome, _ in classified)
    ttfts = [r.first_token_s - r.sent_s for r, o, _ in classified if o is Outcome.COMPLETED]
    refusals = [r.end_s - r.sent_s for r, o, _ in classified if o is Outcome.REFUSED]
    unfinished = Counter(f"{o.value}: {d}" for _, o, d in classified if o is not Outcome.COMPLETED)
    return {
        "requests": len(records),
        **{outcome.name.lower(): counts[outcome] for outcome in Outcome},
        "refused_by": dict(Counter(d for _, o, d in classified if o is Outcome.REFUSED)),
        "not_completed": dict(unfinished.most_common()),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "refusal_p50": percentile(refusals, 50),
        "refusal_p99": percentile(refusals, 99),
        "drain_s": max((r.end_s for r in records), default=math.nan),
        "last_written_s": max(
            (r.written_s for r in records if r.written_s is not None), default=math.nan
        ),
    }


# -- the client --------------------------------------------------------------------------------


async def stream_into(
    record: StreamedRequest,
    http: aiohttp.ClientSession,
    path: str,
    body: dict,
    start: float,
    timeout_s: float,
    absorb: Callable[[str, float], None],
    trace_context: object = None,
) -> None:
    """POSTs `body` to `path` as one stream and hands `absorb` each SSE `data:` payload with its
    time from `start` (perf_counter). Fills in the record's status, the start of a non-200
    answer, timed_out (no end within `timeout_s`), the exception that ended it, and end_s;
    never raises: one request's failure is a result, not a crash. The client is aiohttp (its
    C parser): a quarter of the CPU per request that httpx spends, which on a host whose cores
    the server shares is time the server gets back (`trace_context`: for the session's
    trace hooks, as aiohttp hands them on)."""

    async def read() -> None:
        async with http.post(path, json=body, trace_request_ctx=trace_context) as response:
            record.status = response.status
            if response.status != 200:
                answer = (await response.read()).decode(errors="replace")
                record.body = " ".join(answer.split())[:200]
                return
            async for line in response.content:
                if line.startswith(b"data:"):
                    absorb(line[5:].decode().strip(), time.perf_counter() - start)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        record.timed_out = True
    except Exception as error:  # noqa: BLE001 - one request's failure is a result, not a crash
        record.exception = f"{type(error).__name__}: {error}"[:200]
    record.end_s = time.perf_counter() - start
