"""The simulator against cases whose answers follow from the step costs alone."""

from __future__ import annotations

import itertools

import pytest

from pdserve.planner.simulator import Layout, NodeCosts, SimSettings, simulate
from pdserve.planner.workload import SimRequest
from pdserve.router.cluster.prefill_placement import DisaggPolicy, Placement, PlacementSettings
from tests.planner.costs import COST, KV_BYTES_PER_TOKEN, TRANSFER_BYTES_PER_S

COSTS = NodeCosts(prefill=COST, decode=COST)


def settings(layout: Layout, policy: DisaggPolicy, chunk: int = 2048, **extra) -> SimSettings:
    return SimSettings(layout, PlacementSettings(policy), chunk, 1 << 20, KV_BYTES_PER_TOKEN,
                       TRANSFER_BYTES_PER_S, **extra)


def test_a_lone_colocated_request_takes_its_prefill_then_one_decode_step_per_token():
    [outcome] = simulate([SimRequest(0.0, 100, 3)], settings(Layout(0, 1), DisaggPolicy.NEVER),
                         COSTS)
    assert outcome.ttft == pytest.approx(COST.prefill_seconds(100))
    assert outcome.itls == pytest.approx([COST.decode_seconds(1, 101),
                                          COST.decode_seconds(1, 102)])


def test_disaggregated_ttft_is_the_prefill_and_the_transfer_delays_the_second_token():
    [outcome] = simulate([SimRequest(0.0, 100, 2)], settings(Layout(1, 1), DisaggPolicy.ALWAYS),
                         COSTS)
    transfer = 100 * KV_BYTES_PER_TOKEN / TRANSFER_BYTES_PER_S
    assert outcome.placement is Placement.REMOTE
    assert outcome.ttft == pytest.approx(COST.prefill_seconds(100))
    assert outcome.itls == pytest.approx([transfer + COST.decode_seconds(1, 101)])


def test_chunked_prefill_overlaps_every_transfer_but_the_last_chunks():
    [outcome] = simulate([SimRequest(0.0, 200, 2)],
                         settings(Layout(1, 1), DisaggPolicy.ALWAYS, chunk=100), COSTS)
    first, second = COST.prefill_seconds(100), COST.prefill_seconds(100, context_before=100)
    assert outcome.ttft == pytest.approx(first + second)
    last_copy = 100 * KV_BYTES_PER_TOKEN / TRANSFER_BYTES_PER_S
    assert outcome.itls == pytest.approx([last_copy + COST.decode_seconds(1, 201)])


def test_a_saturated_queue_grows_linearly():
    """One seat, ten identical requests at once: each waits for all before it."""
    requests = [SimRequest(0.0, 64, 4) for _ in range(10)]
    outcomes = simulate(requests, settings(Layout(0, 1), DisaggPolicy.NEVER, max_num_seqs=1),
                        COSTS)
    service = outcomes[0].finished_s
    ttfts = [o.ttft for o in outcomes]
    assert [b - a for a, b in itertools.pairwise(ttfts)] == pytest.approx([service] * 9)


def test_auto_computes_a_prompt_of_local_prefill_tokens_locally_and_a_longer_one_remotely():
    limit = PlacementSettings().local_prefill_tokens  # the router's own default
    requests = [SimRequest(0.0, limit, 2), SimRequest(10.0, limit + 1, 2)]
    short, long = simulate(requests, settings(Layout(1, 1), DisaggPolicy.AUTO), COSTS)
    assert (short.placement, long.placement) == (Placement.LOCAL, Placement.REMOTE)


def test_auto_computes_locally_when_the_prefill_queue_is_long():
    """A burst of long prompts: once the prefill node's backlog passes the queue-delay bound,
    the idle decode node takes the next one."""
    requests = [SimRequest(0.0, 1500, 2) for _ in range(4)]
    outcomes = simulate(requests, settings(Layout(1, 1), DisaggPolicy.AUTO), COSTS)
    placements = [o.placement for o in outcomes]
    assert placements[0] is Placement.REMOTE and Placement.LOCAL in placements


def test_a_cached_shared_prefix_shortens_the_next_prefill():
    first = SimRequest(0.0, 200, 2, prefix_id="system", prefix_tokens=120)
    second = SimRequest(10.0, 200, 2, prefix_id="system", prefix_tokens=120)
    a, b = simulate([first, second], settings(Layout(0, 1), DisaggPolicy.NEVER), COSTS)
    assert a.ttft == pytest.approx(COST.prefill_seconds(200))
    assert b.ttft == pytest.approx(COST.prefill_seconds(200 - 112, context_before=112))


def test_a_closed_loop_sends_each_request_when_the_previous_one_finishes():
    requests = [SimRequest(0.0, 64, 3) for _ in range(3)]
    outcomes = simulate(requests, settings(Layout(0, 1), DisaggPolicy.NEVER), COSTS,
                        max_concurrency=1)
    assert [o.ttft for o in outcomes] == pytest.approx([COST.prefill_seconds(64)] * 3)
    assert outcomes[1].request.arrival_s == pytest.approx(outcomes[0].finished_s)


def test_the_decode_node_borrows_the_idle_prefill_cores():
    fast = type(COST)(tuple(c / 2 for c in COST.coefficients))
    borrowing = NodeCosts(prefill=COST, decode=COST, decode_while_prefill_idle=fast)
    [outcome] = simulate([SimRequest(0.0, 100, 2)], settings(Layout(1, 1), DisaggPolicy.ALWAYS),
                         borrowing)
    transfer = 100 * KV_BYTES_PER_TOKEN / TRANSFER_BYTES_PER_S
    assert outcome.itls == pytest.approx([transfer + fast.decode_seconds(1, 101)])


def test_policy_always_without_a_prefill_node_is_refused():
    with pytest.raises(ValueError, match="always needs prefill nodes"):
        settings(Layout(0, 1), DisaggPolicy.ALWAYS)
