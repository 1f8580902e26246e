"""Continuous batching: chunking under the token budget, admission, preemption order."""

from __future__ import annotations

import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.wire.sampling_params import SamplingParams


def make_seq(name: str, num_tokens: int, group: str | None = None, **rank: float) -> Sequence:
    """A sequence of `num_tokens` prompt tokens; `rank` may set its priority and arrival_time."""
    return Sequence(
        name, [1] * num_tokens, SamplingParams(), frozenset(), torch.device("cpu"), group=group,
        **rank,
    )


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.token_ids.append(1)
    return out


def test_long_prompt_is_split_into_chunks_under_the_budget():
    scheduler = Scheduler(BlockManager(64, 16), max_num_batched_tokens=32, max_num_seqs=8)
    seq = make_seq("long", 100)
    scheduler.add(seq)
    chunks = [run_step(scheduler).scheduled[0].num_new_tokens for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert seq.num_output_tokens == 1


def test_decodes_go_first_and_prompts_fill_the_rest_of_the_budget():
    scheduler = Scheduler(BlockManager(64, 16), max_num_batched_tokens=32, max_num_seqs=8)
    first, second = make_seq("a", 10), make_seq("b", 50)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(second)
    out = run_step(scheduler)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 31)]


def test_a_prompt_being_prefilled_keeps_its_turn_over_an_earlier_arrival_of_its_priority():
    """As a dead node's prompts retried on this one, with their first arrival times: they wait
    for the running prompt's chunks (its KV is streaming to a decode node), then go in their
    order; a more important arrival still goes first."""
    scheduler = Scheduler(
        BlockManager(64, 16), max_num_batched_tokens=32, max_num_seqs=8, priority_aging_s=0
    )
    scheduler.add(make_seq("running", 100, arrival_time=10.0))
    run_step(scheduler)
    for name in ("retried-1", "retried-2"):
        scheduler.add(make_seq(name, 40, arrival_time=1.0))
    chunks = [[(s.seq.request_id, s.num_new_tokens) for s in run_step(scheduler).scheduled]
              for _ in range(3)]
    assert chunks == [
        [("running", 32)],
        [("running", 32)],
        [("running", 4), ("retried-1", 28)],
    ]
    scheduler.add(make_seq("urgent", 8, priority=-1, arrival_time=20.0))
    out = run_step(scheduler)
    assert [s.seq.request_id for s in out.scheduled][:2] == ["urgent", "retried-1"]


def test_max_num_seqs_caps_the_running_set():
    scheduler = Scheduler(BlockManager(64, 16), max_num_batched_tokens=1000, max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_seq(str(i), 5))
    out = run_step(scheduler)
    assert len(out.scheduled) == 2 and len(scheduler.waiting) == 1


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(manager, max_num_batched_tokens=100, max_num_seqs=8)
    old, new = make_seq("old", 8), make_seq("new", 8)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    assert manager.num_free_blocks == 0
    out = run_step(scheduler)
    assert [s.request_id for s in out.preempted] == ["new"]
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and scheduler.waiting[0] is new
    assert [s.seq.request_id for s in out.scheduled] == ["old"]
    assert scheduler.num_preemptions == 1
    manager.check_integrity([old.block_table])


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    manager = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(manager, max_num_batched_tokens=100, max_num_seqs=8)
    old, new = make_seq("old", 4), make_seq("new", 8)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    old.token_ids.extend([1] * 3)
    out = run_step(scheduler)
    assert [s.request_id for s in out.preempted] == ["new"]
    assert [s.seq.request_id for s in out.scheduled] == ["old"]


def test_finish_frees_blocks_at_once_from_either_queue():
    manager = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(manager, max_num_batched_tokens=100, max_num_seqs=1)
    running, waiting = make_seq("r", 8), make_seq("w", 8)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    scheduler.finish(running, "abort")
    scheduler.finish(waiting, "abort")
    assert manager.num_free_blocks == 8
    assert scheduler.num_unfinished == 0
    assert running.finish_reason == "abort" and running.status is SequenceStatus.FINISHED
