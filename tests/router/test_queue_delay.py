"""The router's early refusal (router/cluster/queue_delay.py), without processes: the predicted wait
at the node that computes a prompt is its queued prompt tokens over the speed the queue drains
at (the node's own measurement until the router has observed one), or the age of the oldest
request still waiting there; past `max_queue_delay_s` a new request gets 429 before anything
is sent, an empty queue always admits, and retries are never judged again."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.cluster.node_client import NodeClient
from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.cluster.prefill_placement import DisaggPolicy, PlacementSettings
from pdserve.router.cluster.queue_delay import MIN_DRAIN_TOKENS, PromptQueues
from pdserve.router.errors import APIError
from pdserve.wire.messages import PromptProgress, RequestFailed, TokenBatch, TokenUpdate
from pdserve.wire.sampling_params import SamplingParams
from tests.router.test_failover import FakeSocket, generates, stats

PROMPT = list(range(100))  # 100 uncached tokens each

FOUR_TOKENS = SamplingParams(max_tokens=4)


def node(speed: float = 0.0) -> NodeState:
    measured = stats("p", "prefill", prefill_tokens_per_s=speed)
    return NodeState("tcp://p", "p", measured)


def test_an_empty_queue_always_admits_and_the_backlog_uses_the_nodes_speed():
    queues, p = PromptQueues(), node(speed=1_000)
    assert queues.delay(p, 10**6, now=0.0) is None  # one huge prompt alone is not overload
    queues.add(p, "a", 1_500, now=0.0)
    delay = queues.delay(p, 500, now=0.5)
    assert (delay.queued_tokens, delay.tokens_per_s) == (2_000, 1_000)
    assert delay.seconds == pytest.approx(2.0)  # 2,000 tokens at 1,000 tokens/s
    assert "2,000 prompt tokens queued, about 2.0 s" in delay.describe(p)


def test_the_oldest_waiter_bounds_the_delay_when_the_speed_is_unknown():
    queues, p = PromptQueues(), node(speed=0.0)
    queues.add(p, "a", 10, now=0.0)
    queues.add(p, "b", 10, now=3.0)
    delay = queues.delay(p, 10, now=7.0)
    assert delay.seconds == pytest.approx(7.0) and delay.oldest_age_s == pytest.approx(7.0)
    assert "has waited 7.0 s" in delay.describe(p)
    queues.remove(p, "a", now=7.0)
    assert queues.delay(p, 10, now=7.0).seconds == pytest.approx(4.0)


def test_the_observed_drain_speed_replaces_the_nodes_own_measurement():
    queues, p = PromptQueues(), node(speed=50_000)  # a forward pass alone looks fast
    tokens = MIN_DRAIN_TOKENS
    for i in range(10):
        queues.add(p, f"r{i}", tokens, now=0.0)
    queues.started(p, "r0", now=0.1)  # too little seen yet
    assert queues.speed(p) == 50_000
    queues.remove(p, "r2", now=0.5)  # an abort is no evidence of speed
    queues.started(p, "r1", now=1.0)  # two prompts in one busy second
    assert queues.speed(p) == pytest.approx(2 * tokens / 1.0, rel=0.06)
    assert queues.tokens(p) == 7 * tokens and len(queues) == 7
    queues.forget(p)
    assert queues.tokens(p) == 0 and len(queues) == 0
    assert queues.speed(p) == pytest.approx(2 * tokens / 1.0, rel=0.06)


def test_a_batched_prefill_that_starts_requests_in_clusters_is_averaged():
    """14 prompts of 140 tokens start together every 3.4 s (one prefill step of 2,048
    tokens): the speed is 14 x 140 / 3.4 tokens/s, not the rate inside a cluster."""
    queues, p = PromptQueues(), node(speed=50_000)
    for i in range(14 * 6):
        queues.add(p, f"r{i}", 140, now=0.0)
    for step in range(6):
        for i in range(14):
            queues.started(p, f"r{14 * step + i}", now=3.4 * (step + 1) + 0.001 * i)
        if step >= 1:
            assert queues.speed(p) == pytest.approx(14 * 140 / 3.4, rel=0.1)


def test_a_few_short_requests_measure_no_speed():
    queues, p = PromptQueues(), node(speed=2_000)
    queues.add(p, "a", 10, now=0.0)
    queues.add(p, "b", 10, now=0.0)
    queues.started(p, "a", now=0.8)  # latency-bound: 20 tokens in 0.9 s say nothing
    queues.started(p, "b", now=0.9)
    assert queues.speed(p) == 2_000


def test_idle_time_between_requests_is_not_counted_as_slowness():
    queues, p = PromptQueues(), node()
    queues.add(p, "a", MIN_DRAIN_TOKENS, now=0.0)
    queues.started(p, "a", now=0.5)  # the queue empties until t = 10
    queues.add(p, "b", MIN_DRAIN_TOKENS, now=10.0)
    queues.started(p, "b", now=10.5)
    assert queues.speed(p) == pytest.approx(2 * MIN_DRAIN_TOKENS / 1.0, rel=0.06)


def client_with(*roles: str, max_queue_delay_s: float = 2.0):
    """A client of live nodes (p, d, c) that each prefill 100 tokens/s; a decode node's
    prompts are computed on the prefill node (`--disagg-policy always`)."""
    client = NodeClient(
        [f"{r}=tcp://{r}" for r in roles], "tcp://router", 1.0, max_queue_delay_s=max_queue_delay_s,
        placement=PlacementSettings(DisaggPolicy.ALWAYS),
    )
    sockets = {}
    for n in client.nodes:
        n.socket = sockets[n.node_id] = FakeSocket()
        role = {"p": "prefill", "d": "decode", "c": "colocated"}[n.node_id[0]]
        client.record_stats(stats(n.node_id, role, prefill_tokens_per_s=100.0))
    return client, sockets


@pytest.mark.parametrize("roles", [("p", "d"), ("c",)], ids=["disaggregated", "colocated"])
def test_requests_past_the_queue_delay_are_refused_before_anything_is_sent(roles):
    async def run():
        client, sockets = client_with(*roles)
        serving = sockets["d" if "d" in roles else "c"]
        queue: asyncio.Queue = asyncio.Queue()
        admitted = []
        for i in range(5):
            try:
                client.submit(f"r{i}", [i, *PROMPT], FOUR_TOKENS, queue)
                admitted.append(f"r{i}")
            except APIError as refusal:
                assert refusal.status == 429 and refusal.code == "rate_limit_exceeded"
                assert "100 tokens/s" in refusal.message and "2 s" in refusal.message
        # 100 tokens/s and 2 s: the first enters an empty queue; 202 tokens would take 2.02 s.
        assert admitted == ["r0"]
        return client, serving

    client, serving = asyncio.run(run())
    assert [m.request_id for m in generates(serving)] == ["r0"]
    assert len(client.inflight) == 1 and len(client.prompt_queues) == 1


def test_a_started_request_leaves_the_queue_and_retries_are_not_judged_again():
    async def run():
        client, sockets = client_with("p", "d", max_queue_delay_s=1.5)
        queue: asyncio.Queue = asyncio.Queue()
        client.submit("a", PROMPT, FOUR_TOKENS, queue)  # 100 tokens: 1 s of work
        with pytest.raises(APIError):  # 200 uncached tokens (another prompt): 2 s
            client.submit("b", PROMPT[::-1], FOUR_TOKENS, queue)
        client._dispatch(RequestFailed("a", "no KV blocks free in time", 503))
        assert [m.request_id for m in generates(sockets["d"])] == ["a", "a~1"]  # retried
        client._dispatch(TokenBatch("p", [TokenUpdate("a~1", [7], None, offset=0)]))
        assert len(client.prompt_queues) == 0
        client._dispatch(TokenBatch("d", [TokenUpdate("a~1", [8], "length", offset=1)]))
        assert not client.inflight and not client.inflight.retry_ids  # the retry's id is forgotten
        client.submit("c", PROMPT[::-1], FOUR_TOKENS, queue)
        client.abort("c")
        assert len(client.prompt_queues) == 0
        assert all(client.prompt_queues.tokens(n) == 0 for n in client.nodes)

    asyncio.run(run())


def test_a_prompt_being_computed_is_served_not_waiting():
    """A long prompt prefilled chunk by chunk for minutes on a busy host: its chunks drain the
    backlog and measure the speed, and its age never counts as a stall; a prompt that
    waits behind it still does."""
    queues, p = PromptQueues(), node(speed=0.0)
    queues.add(p, "long", 8_000, now=0.0)
    queues.progress(p, "long", 2_000, now=10.0)
    queues.progress(p, "long", 4_000, now=20.0)
    queues.progress(p, "long", 3_000, now=21.0)  # out of order: nothing moves back
    delay = queues.delay(p, 100, now=60.0)
    assert delay.oldest_age_s == 0.0 and delay.queued_tokens == 4_100
    assert queues.speed(p) == pytest.approx(4_000 / 21.0, rel=0.1)  # per busy second
    assert delay.seconds == pytest.approx(4_100 / queues.speed(p))
    queues.add(p, "behind", 100, now=60.0)
    assert queues.delay(p, 100, now=90.0).oldest_age_s == pytest.approx(30.0)
    queues.progress(p, "long", 10**9, now=90.0)  # bounded by what the router counted
    assert queues.tokens(p) == 100
    queues.started(p, "long", now=95.0)
    assert queues.tokens(p) == 100 and len(queues) == 1


def test_prompt_progress_from_a_node_reaches_the_request_its_choice_group_or_its_retry():
    async def run():
        client, _ = client_with("p", "d", max_queue_delay_s=3.0)
        queue: asyncio.Queue = asyncio.Queue()
        client.submit("a", PROMPT, FOUR_TOKENS, queue)  # 100 tokens at 100 tokens/s
        client.submit_choices(
            "g", [5, *PROMPT], [("g-0", FOUR_TOKENS), ("g-1", FOUR_TOKENS)], queue
        )
        prefill = next(n for n in client.nodes if n.role == "prefill")
        assert client.prompt_queues.tokens(prefill) == 201
        client._dispatch(PromptProgress("p", {"a": 60, "g": 101, "unknown": 5, "x": "7"}))
        assert client.prompt_queues.tokens(prefill) == 40
        delay = client.prompt_queues.delay(prefill, 0, now=client.clock() + 100)
        assert delay.oldest_age_s == 0.0  # both are being computed
        client._dispatch(RequestFailed("a", "lost", 503))  # retried as a~1, waiting again
        retried = client.prompt_queues.tokens(prefill)  # (the prefill node caches its prefix)
        assert retried > 0
        client._dispatch(PromptProgress("p", {"a": 100}))  # the attempt given up: ignored
        assert client.prompt_queues.tokens(prefill) == retried
        client._dispatch(PromptProgress("p", {"a~1": 1}))
        assert client.prompt_queues.tokens(prefill) == retried - 1
        firsts = [TokenUpdate(f"g-{i}", [7], None, offset=0) for i in range(2)]
        client._dispatch(TokenBatch("p", firsts))
        assert not client.inflight.prompt_ids

    asyncio.run(run())


@pytest.mark.parametrize("roles", [("p", "d"), ("c",)], ids=["disaggregated", "colocated"])
def test_a_node_already_past_the_bound_refuses_before_the_request_is_read(roles):
    """The route's first check (router/api/routes.py): once even an empty prompt would wait past
    the bound at every node that could compute it, the request is refused before its body is
    read or tokenized; while one node could still take it, nothing is refused early."""

    async def run():
        client, _ = client_with(*roles, max_queue_delay_s=1.5)
        client.check_overload()  # empty queues always admit
        client.submit("a", PROMPT, FOUR_TOKENS, asyncio.Queue())  # 1 s of work queued
        client.check_overload()  # 0 new tokens: 1 s < 1.5 s
        computing = client.inflight.entries["a"].queued_at
        client.prompt_queues.add(computing, "backlog", 100, client.clock())  # 2 s queued now
        with pytest.raises(APIError) as refused:
            client.check_overload()
        assert refused.value.status == 429 and "200 prompt tokens queued" in refused.value.message
        client.prompt_queues.remove(computing, "backlog", client.clock())
        client.check_overload()
        # a burst: one request still being read and tokenized, counted as ~100 tokens
        with client.arriving(), pytest.raises(APIError):
            client.check_overload()  # 1 s queued + 1 s arriving > 1.5 s
        client.check_overload()

    asyncio.run(run())
