"""n choices of one prompt travel as ONE Generate (router/choice_groups.py): choice index
prompt x n + i with batched prompts, each choice its own id and seed + i; the node client
tracks each choice as a request of its own (its tokens, its abort, its retry, alone), and the
prompt waits in the prefill node's queue once."""

from __future__ import annotations

import asyncio

from pdserve.router.api.validation import Plan
from pdserve.router.choice_groups import choice_groups
from pdserve.wire.messages import RequestFailed, TokenUpdate
from pdserve.wire.sampling_params import SamplingParams
from tests.router.test_failover import aborts, cluster, drain, generates, node


def plan(prompts: list[list[int]], n: int, seed: int = 100, **extra) -> Plan:
    samplings = [
        SamplingParams(max_tokens=4, seed=seed + i, **extra) for _ in prompts for i in range(n)
    ]
    return Plan(prompts, samplings, [])


def test_each_prompt_carries_its_n_choices_indexed_prompt_times_n_plus_i():
    groups = choice_groups("cmpl-x", plan([[5, 6], [7], [8, 9, 10]], n=3))
    assert [g.prompt for g in groups] == [[5, 6], [7], [8, 9, 10]]
    assert [g.indices for g in groups] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [c for c, _ in groups[1].choices] == ["cmpl-x-3", "cmpl-x-4", "cmpl-x-5"]
    assert [s.seed for _, s in groups[2].choices] == [100, 101, 102]
    assert len({g.prompt_id for g in groups}) == 3
    assert all(g.prompt_id not in dict(g.choices) for g in groups)


def test_structured_output_choices_travel_one_message_each():
    spec = {"regex": "a+"}
    groups = choice_groups("r", plan([[5]], n=2, structured_output=spec))
    assert [(g.prompt_id, g.indices) for g in groups] == [("r-0", [0]), ("r-1", [1])]


def test_one_generate_for_n_choices_and_each_choice_a_request_of_its_own():
    client, _, sockets = cluster("p0", "d0")

    async def run():
        (group,) = choice_groups("g", plan([[1, 2, 3]], n=4))
        queue = client.submit_choices(group.prompt_id, group.prompt, group.choices, group="g")
        (sent,) = generates(sockets["d0"])
        assert sent.request_id == "g-p0" and sent.prefill_address == "tcp://p0"
        assert sent.group == "g"  # the client request, for the engine's fair share
        assert [(c.request_id, c.sampling.seed) for c in sent.choices] == [
            ("g-0", 100), ("g-1", 101), ("g-2", 102), ("g-3", 103)
        ]
        assert set(client.inflight.entries) == {"g-0", "g-1", "g-2", "g-3"}
        assert client.prompt_queues.tokens(node(client, "p0")) == 3  # the prompt, once
        for i in range(4):  # first tokens from the prefill node, under each choice's id
            client.inflight.deliver(TokenUpdate(f"g-{i}", [10 + i], offset=0))
        assert client.prompt_queues.tokens(node(client, "p0")) == 0
        client.abort("g-1")
        assert aborts(sockets["d0"]) == ["g-1"] and aborts(sockets["p0"]) == ["g-1"]
        client.inflight.deliver(TokenUpdate("g-0", [20], "length", offset=1))
        return [(u.request_id, u.token_ids) for u in drain(queue)]

    assert asyncio.run(run()) == [("g-0", [10]), ("g-1", [11]), ("g-2", [12]), ("g-3", [13]),
                                  ("g-0", [20])]
    assert set(client.inflight.entries) == {"g-2", "g-3"}


def test_a_choice_lost_before_its_first_token_is_retried_alone():
    client, _, sockets = cluster("p0", "p1", "d0")

    async def run():
        (group,) = choice_groups("h", plan([[1, 2, 3]], n=2))
        queue = client.submit_choices(group.prompt_id, group.prompt, group.choices)
        client._dispatch(RequestFailed("h-1", "KV transfer failed", 503))
        client._dispatch(RequestFailed("h-0", "KV transfer failed", 503))
        return queue

    queue = asyncio.run(run())
    first, *retries = generates(sockets["d0"])
    assert [c.request_id for c in first.choices] == ["h-0", "h-1"]
    assert sorted((r.request_id, r.sampling.seed, r.choices) for r in retries) == [
        ("h-0~1", 100, []), ("h-1~1", 101, [])
    ]
    assert all(r.prefill_address == "tcp://p1" for r in retries)
    assert not drain(queue)  # nothing failed: both retried
