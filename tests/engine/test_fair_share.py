"""Fair share (engine/sched/request_share.py): one client request's sequences beyond its share rank
behind every other request's first share, so a request arriving while a big one runs is
scheduled in the first step after its arrival (the bound in engine/sched/scheduler.py)."""

from __future__ import annotations

import pytest

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sched.request_share import RequestShares
from pdserve.engine.sched.scheduler import Scheduler
from tests.engine.test_scheduler import make_seq, run_step


def finish_all(scheduler: Scheduler) -> None:
    for seq in [*scheduler.running, *scheduler.waiting]:
        scheduler.finish(seq, "abort")
    manager = scheduler.block_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def scheduled_ids(out) -> list[str]:
    return [s.seq.request_id for s in out.scheduled]


@pytest.mark.parametrize("arrives_after_steps", [1, 3, 6])
def test_a_small_request_is_seated_at_once_beside_a_request_that_fills_the_seats(
    arrives_after_steps,
):
    scheduler = Scheduler(BlockManager(256, 16), max_num_batched_tokens=1000, max_num_seqs=8)
    assert scheduler.shares.share == 2
    for i in range(16):
        scheduler.add(make_seq(f"big-{i}", 5, group="big"))
    for _ in range(arrives_after_steps):
        assert len(run_step(scheduler).scheduled) == 8  # the big request alone fills the batch
    victim = make_seq("victim", 5)
    scheduler.add(victim)
    out = run_step(scheduler)
    assert "victim" in scheduled_ids(out)
    assert victim.num_output_tokens == 1  # its whole prompt, so its first token, in that step
    # it took the seat of the big request's lowest-ranked sequence, one beyond its share
    assert [seq.share_tier for seq in out.preempted] == [3]
    assert scheduler.num_running_seqs == 8
    finish_all(scheduler)


def test_a_big_requests_prompts_beyond_its_share_leave_the_budget_to_a_newcomer():
    scheduler = Scheduler(BlockManager(256, 16), max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(2):  # its first share: short prompts, decoding after one step
        scheduler.add(make_seq(f"big-{i}", 5, group="big"))
    for i in range(2, 4):  # beyond its share: long prompts, chunked
        scheduler.add(make_seq(f"big-{i}", 300, group="big"))
    run_step(scheduler)
    victim = make_seq("victim", 40)
    scheduler.add(victim)
    out = run_step(scheduler)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("big-0", 1),
        ("big-1", 1),
        ("victim", 40),
        ("big-2", 22),
    ]
    assert victim.num_output_tokens == 1 and not out.preempted
    finish_all(scheduler)


def test_a_lone_big_request_uses_every_seat_and_the_budget():
    scheduler = Scheduler(BlockManager(256, 16), max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(8):
        scheduler.add(make_seq(f"big-{i}", 8, group="big"))
    out = run_step(scheduler)
    assert len(out.scheduled) == 8 and out.num_batched_tokens == 64
    finish_all(scheduler)


def test_a_prompts_choices_take_consecutive_ordinals_of_their_request():
    shares = RequestShares(max_num_seqs=8)  # share 2
    first, second = make_seq("p0", 5, group="r"), make_seq("p1", 5, group="r")
    first.children = [make_seq(f"c{i}", 5, group="r") for i in range(3)]
    second.children = [make_seq(f"d{i}", 5, group="r") for i in range(2)]
    shares.enter(first)
    shares.enter(second)
    assert first.share_tier == 0 and [c.share_tier for c in first.children] == [0, 0, 1]
    assert second.share_tier == 1 and [c.share_tier for c in second.children] == [1, 2]
    for child in first.children:  # the fork: each choice keeps the ordinal it came with
        shares.enter(child)
    assert [c.share_tier for c in first.children] == [0, 0, 1]
    other = make_seq("other", 5)
    shares.enter(other)
    assert other.share_tier == 0


def test_a_request_that_finished_starts_its_shares_again():
    shares = RequestShares(max_num_seqs=4)  # share 1
    first = make_seq("a", 5, group="r")
    shares.enter(first)
    shares.leave(first)
    again = make_seq("b", 5, group="r")
    shares.enter(again)
    assert again.share_tier == 0
