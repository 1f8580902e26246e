"""The order in which the scheduler serves sequences: priority, aged by waiting time.

A sequence's rank is `arrival_time + priority * aging_s` (smaller is served first and preempted
last): one priority level is worth `aging_s` seconds of waiting. Ranks never change, so the
relative order of two requests is fixed, and a request of priority p that arrived at t goes
ahead of every request of priority q that arrives after t + (p - q) * aging_s. That is the
starvation bound: a flood of more important requests delays it only by the work of those that
arrived before that moment. With aging_s = 0 priorities are strict (ties by arrival) and a
steady flood of more important requests can starve the rest.
Ties go to the earlier arrival, then to the earlier submission (`Sequence.sequence_number`).
Before all of this comes the sequence's share of its client request (`Sequence.share_tier`,
engine/sched/request_share.py): every request's first share ranks ahead of any request's second, so
the bounds above hold between shares of the same tier.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from pdserve.engine.sequence import Sequence


class PriorityOrder:
    def __init__(self, aging_s: float) -> None:
        if aging_s < 0:
            raise ValueError(f"priority aging must be >= 0 seconds, got {aging_s}")
        self.aging_s = aging_s

    def rank(self, seq: Sequence) -> tuple[float, ...]:
        return (
            seq.share_tier or 0,
            *self.rank_of(seq.priority, seq.arrival_time, seq.sequence_number),
        )

    def rank_of(self, priority: int, arrival_time: float, number: int) -> tuple[float, ...]:
        """The rank of anything waiting with a priority and an arrival time (`number`, unique
        and increasing, breaks ties)."""
        if self.aging_s == 0:
            return (priority, arrival_time, number)
        return (arrival_time + priority * self.aging_s, arrival_time, number)


class SequenceQueue:
    """Sequences kept sorted by rank: [0] is served first, [-1] is the first preemption victim."""

    def __init__(self, order: PriorityOrder) -> None:
        self.order = order
        self._items: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._items, seq, key=self.order.rank)

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def pop_first(self) -> Sequence:
        return self._items.pop(0)

    def __getitem__(self, index: int) -> Sequence:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def __contains__(self, seq: object) -> bool:
        return seq in self._items
