"""Drives an `LLMEngine` in real time: requests arrive at set times (open loop) or when an
earlier one finishes (closed loop, e.g. the next turn of a chat), and every request's arrival,
first token, finish and prefix-cache reuse are recorded."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.bench.workload import greedy


@dataclass
class Arrival:
    at: float
    prompt: list[int]
    max_tokens: int
    tag: str = ""


@dataclass
class Record:
    request_id: str
    tag: str
    prompt: list[int]
    arrived: float
    first_token: float | None = None
    finished: float | None = None
    num_cached_tokens: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrived


FollowUp = Callable[[Record], Arrival | None]


def drive(engine, arrivals: list[Arrival], follow_up: FollowUp | None = None) -> list[Record]:
    """Runs until every request, follow-ups included, has finished; returns them in arrival
    order. `follow_up(record)` may return the arrival a finished request triggers."""
    serial = itertools.count()
    pending = [(a.at, next(serial), a) for a in arrivals]
    heapq.heapify(pending)
    records: dict[str, Record] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, number, arrival = heapq.heappop(pending)
            request_id = f"r{number}"
            records[request_id] = Record(request_id, arrival.tag, arrival.prompt, at)
            engine.add_request(request_id, arrival.prompt, greedy(arrival.max_tokens))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outputs = engine.step().outputs
        now = time.perf_counter() - start
        for output in outputs:
            record = records[output.request_id]
            if record.first_token is None:
                record.first_token = now
                record.num_cached_tokens = output.num_cached_tokens
            record.output.extend(output.new_token_ids)
            if output.finish_reason is None:
                continue
            record.finished = now
            following = follow_up(record) if follow_up else None
            if following is not None:
                following.at = now
                heapq.heappush(pending, (now, next(serial), following))
    return sorted(records.values(), key=lambda r: (r.arrived, int(r.request_id[1:])))


def ideal_cached_tokens(
    records: list[Record], block_size: int, history: list[Record] = ()
) -> list[int]:
    """For each request, the most prompt tokens any cache could have served: its longest
    common prefix with an earlier request's computed tokens (prompt and all but the last
    output token; `history` ran before all of them), in whole blocks, leaving at least one
    token to compute."""
    ideal = []
    for index, record in enumerate(records):
        best = 0
        for earlier in [*history, *records[:index]]:
            computed = earlier.prompt + earlier.output[:-1]
            best = max(best, _common_prefix(record.prompt, computed))
        best = min(best, len(record.prompt) - 1)
        ideal.append(best // block_size * block_size)
    return ideal


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
