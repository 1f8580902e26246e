"""Priorities: the waiting queue orders by (aged) priority, victims come from the least important,
a more important request preempts a less important one, and aging bounds starvation."""

from __future__ import annotations

import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.wire.sampling_params import SamplingParams


def make_seq(name: str, num_tokens: int, priority: int, arrival: float, max_tokens: int = 4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(
        name, [1] * num_tokens, params, frozenset(), torch.device("cpu"), priority, arrival
    )


def step(scheduler: Scheduler) -> list[str]:
    """One step as the engine runs it (without a model); returns the ids that finished."""
    finished = []
    for scheduled in scheduler.schedule().scheduled:
        seq = scheduled.seq
        samples = scheduled.completes_prompt
        seq.num_computed_tokens += scheduled.num_new_tokens
        if samples and seq.append_token(1) is not None:
            scheduler.finish(seq, "length")
            finished.append(seq.request_id)
    return finished


def test_waiting_requests_are_served_by_priority_then_arrival():
    scheduler = Scheduler(BlockManager(64, 16), 4096, max_num_seqs=1, priority_aging_s=0)
    for name, priority, arrival in (("late-0", 0, 2.0), ("low", 3, 0.0), ("early-0", 0, 1.0)):
        scheduler.add(make_seq(name, 8, priority, arrival))
    order = []
    while scheduler.num_unfinished:
        order += step(scheduler)
    assert order == ["early-0", "late-0", "low"]


def test_a_block_shortage_preempts_the_least_important_running_request():
    manager = BlockManager(6, 4)
    scheduler = Scheduler(manager, 4096, max_num_seqs=8, watermark=0, priority_aging_s=0)
    important = make_seq("important", 7, priority=0, arrival=1.0, max_tokens=8)
    unimportant = make_seq("unimportant", 7, priority=5, arrival=0.0, max_tokens=8)
    scheduler.add(unimportant)
    scheduler.add(important)
    preempted = []
    for _ in range(20):
        out = scheduler.schedule()
        preempted += [s.request_id for s in out.preempted]
        for scheduled in out.scheduled:
            seq = scheduled.seq
            samples = scheduled.completes_prompt
            seq.num_computed_tokens += scheduled.num_new_tokens
            if samples and seq.append_token(1) is not None:
                scheduler.finish(seq, "length")
        if not scheduler.num_unfinished:
            break
    assert preempted and set(preempted) == {"unimportant"}
    manager.check_integrity([])


def test_a_more_important_arrival_preempts_a_less_important_running_request():
    manager = BlockManager(8, 4)
    scheduler = Scheduler(manager, 4096, max_num_seqs=1, watermark=0, priority_aging_s=0)
    low = make_seq("low", 10, priority=2, arrival=0.0, max_tokens=50)
    scheduler.add(low)
    step(scheduler)
    high = make_seq("high", 10, priority=0, arrival=1.0)
    scheduler.add(high)
    out = scheduler.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["high"]
    assert out.preempted == [low] and low.status is SequenceStatus.WAITING
    assert scheduler.waiting[0] is low


def flood(aging_s: float, steps: int = 400) -> tuple[int | None, list[tuple[str, float]]]:
    """One low-priority request (priority 5, arrival 0) against a flood of priority-0 requests
    arriving every 0.1 s (simulated clock: 0.1 s per step). Returns the step at which the low
    one was admitted and every admission (id, arrival) in order."""
    scheduler = Scheduler(BlockManager(256, 16), 4096, max_num_seqs=2, priority_aging_s=aging_s)
    scheduler.add(make_seq("low", 8, priority=5, arrival=0.0))
    admitted: list[tuple[str, float]] = []
    low_admitted_at = None
    for index in range(steps):
        now = index * 0.1
        for extra in range(2):  # two arrivals per step: more than the server can take
            scheduler.add(make_seq(f"high-{index}-{extra}", 8, priority=0, arrival=now))
        before = {s.request_id for s in scheduler.running}
        step(scheduler)
        for seq in scheduler.running:
            if seq.request_id not in before:
                admitted.append((seq.request_id, seq.arrival_time))
        if low_admitted_at is None and any(r == "low" for r, _ in admitted):
            low_admitted_at = index
    return low_admitted_at, admitted


def test_aging_bounds_how_long_a_flood_of_important_requests_delays_a_low_priority_one():
    aging_s = 0.5
    low_admitted_at, admitted = flood(aging_s)
    assert low_admitted_at is not None
    # The stated bound: nothing that arrived after 0 + (5 - 0) * aging_s is admitted first.
    position = [r for r, _ in admitted].index("low")
    assert all(arrival <= 5 * aging_s for _, arrival in admitted[:position])
    assert max(arrival for _, arrival in admitted[:position]) > 5 * aging_s - 0.5


def test_without_aging_a_flood_starves_the_low_priority_request():
    low_admitted_at, _ = flood(aging_s=0, steps=200)
    assert low_admitted_at is None
