"""Conditional disaggregation (router/cluster/prefill_placement.py), without processes: where
the prompt of a request sent to a decode node is computed under each `--disagg-policy`, what
the decode node is told (a Generate naming a prefill node, or none), and how each choice is
counted."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdserve.router.cluster.prefill_placement import DisaggPolicy, PlacementSettings
from pdserve.router.config import RouterConfig
from pdserve.wire.sampling_params import SamplingParams
from tests.router.test_failover import NODE_TIMEOUT_S, beat, cluster, generates, node, stats

ONE_TOKEN = SamplingParams(max_tokens=1)
LOCAL_PREFILL_TOKENS = 32


def placed_cluster(policy: DisaggPolicy):
    registry = CollectorRegistry()
    settings = PlacementSettings(policy, local_prefill_tokens=LOCAL_PREFILL_TOKENS)
    client, clock, sockets = cluster("p0", "d0", placement=settings, registry=registry)
    return client, clock, sockets, registry


def placements(registry: CollectorRegistry, placement: str, reason: str) -> float:
    labels = {"placement": placement, "reason": reason}
    return registry.get_sample_value("pdserve_prefill_placements_total", labels) or 0.0


def sent_prefill(client, sockets, request_id: str, prompt: list[int]) -> str | None:
    """Submits the prompt; the prefill address of the Generate the decode node got."""
    client.submit(request_id, prompt, ONE_TOKEN, asyncio.Queue())
    (message,) = [g for g in generates(sockets["d0"]) if g.request_id == request_id]
    return message.prefill_address


def test_always_sends_every_prompt_to_a_prefill_node_and_needs_one():
    client, clock, sockets, registry = placed_cluster(DisaggPolicy.ALWAYS)
    assert sent_prefill(client, sockets, "short", list(range(5))) == "tcp://p0"
    assert placements(registry, "remote", "policy") == 1
    beat(client, clock, "d0", until=NODE_TIMEOUT_S + 1)  # p0 falls silent
    assert not node(client, "p0").up
    with pytest.raises(LookupError):
        client.submit("after", list(range(5)), ONE_TOKEN, asyncio.Queue())


def test_never_computes_every_prompt_on_the_decode_node():
    client, _, sockets, registry = placed_cluster(DisaggPolicy.NEVER)
    assert sent_prefill(client, sockets, "long", list(range(300))) is None
    assert generates(sockets["p0"]) == []
    assert placements(registry, "local", "policy") == 1
    # The decode node computes it: its queue holds the whole prompt.
    assert client.prompt_queues.tokens(node(client, "d0")) == 300
    assert client.prompt_queues.tokens(node(client, "p0")) == 0


def test_auto_keeps_short_prompts_local_and_sends_long_ones_to_a_prefill_node():
    client, _, sockets, registry = placed_cluster(DisaggPolicy.AUTO)
    assert sent_prefill(client, sockets, "short", list(range(LOCAL_PREFILL_TOKENS))) is None
    assert sent_prefill(client, sockets, "long", list(range(500, 560))) == "tcp://p0"
    assert placements(registry, "local", "short_prompt") == 1
    assert placements(registry, "remote", "long_prompt") == 1
    assert client.prompt_queues.tokens(node(client, "p0")) == 60


def test_auto_counts_only_the_tokens_the_decode_node_lacks():
    """A follow-up turn whose first 32 tokens the decode node computed before lacks 28 of its
    60: it stays local; the same length without the shared prefix goes to the prefill node."""
    client, _, sockets, registry = placed_cluster(DisaggPolicy.AUTO)
    first_turn = list(range(LOCAL_PREFILL_TOKENS))
    assert sent_prefill(client, sockets, "turn-1", first_turn) is None
    follow_up = [*first_turn, *range(1000, 1028)]
    assert sent_prefill(client, sockets, "turn-2", follow_up) is None
    assert sent_prefill(client, sockets, "stranger", list(range(2000, 2060))) == "tcp://p0"
    assert placements(registry, "local", "short_prompt") == 2
    assert client.prompt_queues.tokens(node(client, "d0")) == 32 + 28


def test_auto_computes_a_long_prompt_locally_when_the_prefill_queue_is_long():
    client, clock, sockets, registry = placed_cluster(DisaggPolicy.AUTO)
    assert sent_prefill(client, sockets, "waiting", list(range(100, 200))) == "tcp://p0"
    beat(client, clock, "p0", "d0", until=2.0)  # not started yet: its queue delay is 2 s
    assert sent_prefill(client, sockets, "next", list(range(300, 400))) is None
    assert placements(registry, "local", "prefill_queue") == 1


@pytest.mark.parametrize(
    ("prefill_speed", "decode_speed", "placed_on"),
    [
        (500.0, 1000.0, None),  # 100 tokens: 0.2 s there, 0.1 s here: computed here
        (1000.0, 1000.0, "tcp://p0"),  # as fast: the prefill node, sparing the streams
        (1000.0, 0.0, "tcp://p0"),  # the decode node's speed not known yet: as fast
        (10_000.0, 1000.0, "tcp://p0"),  # 0.01 s there: under the threshold
    ],
)
def test_auto_counts_the_prompt_itself_when_the_prefill_queue_is_empty(
    prefill_speed, decode_speed, placed_on
):
    """A prefill node slower than the decode node (a CPU host's cores shared between them)
    computes a long prompt later even with nothing queued: it stays on the decode node when
    the prefill node would pass the threshold."""
    registry = CollectorRegistry()
    settings = PlacementSettings(
        DisaggPolicy.AUTO, local_prefill_tokens=LOCAL_PREFILL_TOKENS,
        local_prefill_queue_delay_s=0.05,
    )
    client, _, sockets = cluster("p0", "d0", placement=settings, registry=registry)
    client.record_stats(stats("p0", "prefill", prefill_tokens_per_s=prefill_speed))
    client.record_stats(stats("d0", "decode", prefill_tokens_per_s=decode_speed))
    assert sent_prefill(client, sockets, "long", list(range(100, 200))) == placed_on
    reason = ("local", "prefill_queue") if placed_on is None else ("remote", "long_prompt")
    assert placements(registry, *reason) == 1


def test_auto_serves_from_decode_nodes_while_no_prefill_node_is_alive_and_retries_there():
    """A prompt sent to the prefill node that then goes silent is retried on the decode node
    itself (no token had reached the client); new prompts go there too."""
    client, clock, sockets, registry = placed_cluster(DisaggPolicy.AUTO)
    assert sent_prefill(client, sockets, "long", list(range(100, 200))) == "tcp://p0"
    beat(client, clock, "d0", until=NODE_TIMEOUT_S + 1)
    assert not node(client, "p0").up
    retry = generates(sockets["d0"])[-1]
    assert retry.request_id == "long~1" and retry.prefill_address is None
    assert sent_prefill(client, sockets, "later", list(range(300, 400))) is None
    assert placements(registry, "local", "no_prefill_node") == 2


def test_the_overload_check_judges_the_nodes_that_may_compute_the_prompt():
    for policy, expected in (
        (DisaggPolicy.ALWAYS, ["p0"]), (DisaggPolicy.NEVER, ["d0"]), (DisaggPolicy.AUTO, ["p0", "d0"])
    ):
        client, _, _, _ = placed_cluster(policy)
        decode_node = node(client, "d0")
        candidates = client.placement.candidates(decode_node, [node(client, "p0")])
        assert [n.node_id for n in candidates] == expected, policy


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"disagg_policy": "sometimes"}, "disagg_policy"),
        ({"local_prefill_tokens": -1}, "local_prefill_tokens"),
        ({"local_prefill_tokens": True}, "local_prefill_tokens"),
        ({"local_prefill_queue_delay_s": 0}, "local_prefill_queue_delay_s"),
    ],
)
def test_placement_settings_out_of_range_are_refused_by_name(settings, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(model_path="/m", **settings)
