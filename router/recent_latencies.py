"""`RecentLatencies`: the latencies of the choices the router finished lately, the window the
launcher's SLO planner (`--planner slo`, commands/slo_policy.py) reads its attainment from.

Each choice that got a first token leaves one entry when it finishes: when it finished, its
time to first token (from the request's arrival at the router, as
`pdserve_time_to_first_token_seconds` counts it) and its mean inter-token latency (its TPOT,
(last token - first token) / (tokens - 1); none for a single-token choice). The window keeps the
entries of the last `WINDOW_S` seconds, at most `MAX_ENTRIES` of them (the newest), so its
memory and the admin answer that lists it are bounded however many requests pass.

The targets are not the router's: the planner holds them and counts what met them.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

WINDOW_S = 120.0
MAX_ENTRIES = 2048


@dataclass(frozen=True)
class FinishedChoice:
    finished_at: float  # the router's monotonic clock
    ttft_s: float
    tpot_s: float | None


class RecentLatencies:
    def __init__(self, window_s: float = WINDOW_S, max_entries: int = MAX_ENTRIES) -> None:
        self.window_s = window_s
        self._entries: collections.deque[FinishedChoice] = collections.deque(maxlen=max_entries)

    def record(self, arrived_at: float, first_token_at: float, num_tokens: int,
               now: float) -> None:
        tpot = (now - first_token_at) / (num_tokens - 1) if num_tokens > 1 else None
        self._entries.append(FinishedChoice(now, first_token_at - arrived_at, tpot))

    def describe(self, now: float) -> list[dict[str, float | None]]:
        """The window's entries, oldest first, each as {"age_s", "ttft_s", "tpot_s"}."""
        while self._entries and now - self._entries[0].finished_at > self.window_s:
            self._entries.popleft()
        return [
            {"age_s": round(now - e.finished_at, 4), "ttft_s": round(e.ttft_s, 6),
             "tpot_s": None if e.tpot_s is None else round(e.tpot_s, 6)}
            for e in self._entries
        ]
