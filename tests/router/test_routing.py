"""Router policies without sockets: node registration and pairing, cache-aware prefill routing
with its load-imbalance fallback, decode choice, and in-order delivery of token updates that
arrive from two nodes."""

from __future__ import annotations

import asyncio
import random

from pdserve.router.cluster.inflight import InFlight
from pdserve.router.cluster.node_client import NodeClient
from pdserve.router.cluster.node_registry import NodeRegistry, NodeState
from pdserve.router.cluster.queue_delay import PromptQueues
from pdserve.router.cluster.routing import PrefillRouter, block_hashes, pick_decode_node
from pdserve.wire.messages import NodeStats, TokenBatch, TokenUpdate
from tests.node_stats import node_stats


def stats(node_id: str, role: str, address: str = "", **fields) -> NodeStats:
    values = {"block_size": 16, "model_fingerprint": "m1", "dtype": "float32", **fields}
    return node_stats(node_id=node_id, role=role, listen_address=address, **values)


def registry(addresses=()) -> tuple[NodeRegistry, list[NodeState]]:
    connected: list[NodeState] = []
    return NodeRegistry(list(addresses), 30.0, connected.append, lambda: 0.0), connected


def test_a_node_joins_by_its_listen_address():
    nodes, connected = registry(["p0=tcp://127.0.0.1:1"])
    nodes.record(stats("p0", "prefill", "tcp://127.0.0.1:1"))
    joined = nodes.record(stats("d9", "decode", "tcp://10.0.0.9:5000"))
    assert joined.address == "tcp://10.0.0.9:5000" and connected == [joined]
    assert [n.node_id for n in nodes.live()] == ["p0", "d9"]
    assert nodes.live("decode") == [joined]


def test_a_restarted_node_is_followed_to_its_new_address_and_a_late_stats_moves_nothing():
    disconnected: list[str] = []
    connected: list[str] = []
    nodes = NodeRegistry(
        [], 30.0, lambda node: connected.append(node.address), lambda: 0.0,
        disconnect=lambda node: disconnected.append(node.address),
    )
    nodes.record(stats("d0", "decode", "tcp://10.0.0.1:5000", instance_id="first"))
    nodes.record(stats("d0", "decode", "tcp://10.0.0.1:5000", instance_id="first"))
    moved = nodes.record(stats("d0", "decode", "tcp://10.0.0.2:6000", instance_id="second"))
    assert moved.address == "tcp://10.0.0.2:6000" and not moved.connection_lost
    assert disconnected == ["tcp://10.0.0.1:5000"]
    assert connected == ["tcp://10.0.0.1:5000", "tcp://10.0.0.2:6000"]
    assert [n.node_id for n in nodes.live()] == ["d0"] and len(nodes.nodes) == 1
    # The same process again, or one that restarted at the same address: no new connection.
    nodes.record(stats("d0", "decode", "tcp://10.0.0.2:6000", instance_id="second"))
    nodes.record(stats("d0", "decode", "tcp://10.0.0.2:6000", instance_id="third"))
    assert len(connected) == 2 and len(disconnected) == 1


def test_a_node_with_another_model_dtype_or_block_size_is_refused():
    nodes, _ = registry()
    nodes.record(stats("a", "prefill", "tcp://h:1"))
    for field, value in (("model_fingerprint", "m2"), ("dtype", "bfloat16"), ("block_size", 32)):
        node = nodes.record(stats(f"b-{field}", "decode", f"tcp://h:{field}", **{field: value}))
        assert node.refused and repr(value) in node.refused
        assert node not in nodes.live()
    assert [n.node_id for n in nodes.live()] == ["a"]


def test_prefill_and_decode_nodes_of_another_tensor_parallel_size_are_refused():
    nodes, _ = registry()
    nodes.record(stats("c", "colocated", "tcp://h:0", tensor_parallel_size=4))  # moves no KV
    nodes.record(stats("p", "prefill", "tcp://h:1", tensor_parallel_size=2))
    same = nodes.record(stats("d", "decode", "tcp://h:2", tensor_parallel_size=2))
    other = nodes.record(stats("d1", "decode", "tcp://h:3"))
    also_colocated = nodes.record(stats("c1", "colocated", "tcp://h:4"))
    assert same.refused is None and also_colocated.refused is None
    assert other.refused == (
        "its tensor_parallel_size is 1 but the other prefill and decode nodes have 2: each "
        "prefill rank writes its KV shard to the same decode rank"
    )
    assert [n.node_id for n in nodes.live()] == ["c", "p", "d", "c1"]


def test_block_hashes_chain_whole_blocks():
    a = list(range(40))
    b = list(range(20)) + [999] * 20
    assert len(block_hashes(a, 16)) == 2
    assert block_hashes(a, 16)[0] == block_hashes(b, 16)[0]
    assert block_hashes(a, 16)[1] != block_hashes(b, 16)[1]
    assert block_hashes(list(range(15)), 16) == []


def live_prefill_nodes(count: int) -> list[NodeState]:
    return [
        NodeState(f"tcp://p{i}", f"p{i}", stats(f"p{i}", "prefill"), last_seen=0.0)
        for i in range(count)
    ]


def test_each_system_prompt_stays_on_one_prefill_node():
    rng = random.Random(0)
    router = PrefillRouter(PromptQueues(), imbalance_tokens=10**9)
    nodes = live_prefill_nodes(2)
    systems = [[rng.randrange(500) for _ in range(64)] for _ in range(4)]
    homes: dict[int, set[str]] = {i: set() for i in range(4)}
    for _ in range(40):
        which = rng.randrange(4)
        prompt = systems[which] + [rng.randrange(500) for _ in range(20)]
        node, cached = router.pick(nodes, prompt)
        router.remember(node, prompt)
        assert cached in (0, 64)
        homes[which].add(node.address)
    assert all(len(h) == 1 for h in homes.values())
    assert len(set().union(*homes.values())) == 2, "all prompts went to one node"


def test_an_overloaded_prefill_node_sheds_load_to_the_least_loaded():
    queues = PromptQueues()
    router = PrefillRouter(queues, imbalance_tokens=1000)
    nodes = live_prefill_nodes(2)
    system = list(range(64))
    first, _ = router.pick(nodes, system + [1])
    router.remember(first, system + [1])
    queues.add(first, "a", 900, now=0.0)
    again, cached = router.pick(nodes, system + [2])
    assert again is first and cached == 64
    queues.add(first, "b", 900, now=0.0)
    spilled, cached = router.pick(nodes, system + [3])
    assert spilled is not first and cached == 0


def test_decode_choice_prefers_free_blocks_then_fewer_running():
    a = NodeState("a", "a", stats("a", "decode", num_free_blocks=5, num_running=0))
    b = NodeState("b", "b", stats("b", "decode", num_free_blocks=9, num_running=3))
    c = NodeState("c", "c", stats("c", "decode", num_free_blocks=9, num_running=1))
    assert pick_decode_node([a, b, c]) is c


def test_updates_from_two_nodes_are_delivered_in_output_order():
    client = NodeClient([], "tcp://127.0.0.1:0")
    queue: asyncio.Queue = asyncio.Queue()
    node = NodeState("tcp://d", "d")
    client.inflight.add("r", InFlight(queue, node))
    client._dispatch(TokenBatch("d", [TokenUpdate("r", [7, 8], None, offset=1)]))
    client._dispatch(TokenBatch("d", [TokenUpdate("r", [], "length", offset=3)]))
    assert queue.empty()
    client._dispatch(TokenBatch("p", [TokenUpdate("r", [5], None, offset=0)]))
    delivered = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [(u.token_ids, u.finish_reason) for u in delivered] == [
        ([5], None),
        ([7, 8], None),
        ([], "length"),
    ]
    assert "r" not in client.inflight
