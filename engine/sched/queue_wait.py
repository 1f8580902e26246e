"""Time requests waited before their first step, summed by priority (for the metrics)."""

from __future__ import annotations

import time
from collections import defaultdict

from pdserve.engine.sequence import Sequence


class QueueWaitStats:
    def __init__(self) -> None:
        self.seconds_by_priority: defaultdict[int, float] = defaultdict(float)
        self.count_by_priority: defaultdict[int, int] = defaultdict(int)

    def observe(self, seq: Sequence) -> None:
        """Called for every scheduled sequence; counts each one once, at its first step."""
        if seq.first_scheduled_time is not None:
            return
        seq.first_scheduled_time = time.monotonic()
        self.seconds_by_priority[seq.priority] += seq.first_scheduled_time - seq.arrival_time
        self.count_by_priority[seq.priority] += 1
