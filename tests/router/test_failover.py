"""The router's failure handling without processes: a node is down after two missed heartbeats,
only its own process's heartbeats keep it up, a restart is noticed, and the retry policy (a
request lost before its first token goes to another prefill node under a new id; never once
output reached the client, but still when the tokens that came back were all held back, whose
text the client then sees from the retry alone; bounded; a 503 from a node is retried, a 400 is
not)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.api.validation import Plan
from pdserve.router.cluster.node_client import NodeClient
from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.cluster.prefill_placement import DisaggPolicy, PlacementSettings
from pdserve.router.generation import Generation
from pdserve.router.metrics import RouterMetrics
from pdserve.wire.messages import (
    Abort,
    Generate,
    Heartbeat,
    NodeStats,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
    decode,
)
from pdserve.wire.sampling_params import SamplingParams
from tests.node_stats import node_stats

HEARTBEAT_S = 0.5
NODE_TIMEOUT_S = 2 * HEARTBEAT_S

FOUR_TOKENS = SamplingParams(max_tokens=4)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent.append(decode(data))


def stats(node_id: str, role: str, instance_id: str = "i0", **fields) -> NodeStats:
    return node_stats(
        node_id=node_id, role=role, num_free_blocks=100, num_total_blocks=100,
        listen_address=f"tcp://{node_id}", model_fingerprint="m", dtype="float32",
        block_size=16, instance_id=instance_id, **fields,
    )


def cluster(
    *node_ids: str, max_retries: int = 2, **client_settings
) -> tuple[NodeClient, Clock, dict]:
    """A client that knows live nodes (role from the id's first letter: p, d, c);
    `client_settings`: NodeClient's other keyword arguments. Every prompt sent to a decode
    node is computed on a prefill node (`--disagg-policy always`) unless `placement` says
    otherwise: these tests follow requests through both."""
    clock = Clock()
    roles = {"p": "prefill", "d": "decode", "c": "colocated"}
    client_settings.setdefault("placement", PlacementSettings(DisaggPolicy.ALWAYS))
    client = NodeClient(
        [f"{n}=tcp://{n}" for n in node_ids],
        "tcp://router",
        NODE_TIMEOUT_S,
        clock=clock,
        max_retries=max_retries,
        **client_settings,
    )
    sockets = {}
    for node in client.nodes:
        node.socket = sockets[node.node_id] = FakeSocket()
        client.record_stats(stats(node.node_id, roles[node.node_id[0]]))
    return client, clock, sockets


def beat(client: NodeClient, clock: Clock, *node_ids: str, until: float) -> None:
    """Heartbeats from `node_ids` every HEARTBEAT_S up to `until`; the watchdog runs between."""
    while clock.now + HEARTBEAT_S <= until:
        clock.now += HEARTBEAT_S
        for node_id in node_ids:
            client.registry.beat(Heartbeat(node_id, "i0"))
        client.fail_dead_nodes()
    clock.now = until
    client.fail_dead_nodes()


def generates(socket: FakeSocket) -> list[Generate]:
    return [m for m in socket.sent if isinstance(m, Generate)]


def aborts(socket: FakeSocket) -> list[str]:
    return [m.request_id for m in socket.sent if isinstance(m, Abort)]


def drain(queue: asyncio.Queue) -> list:
    return [queue.get_nowait() for _ in range(queue.qsize())]


def node(client: NodeClient, node_id: str) -> NodeState:
    return next(n for n in client.nodes if n.node_id == node_id)


def test_a_node_is_down_after_two_missed_heartbeats_and_up_at_the_next():
    client, clock, _ = cluster("p0", "d0")
    beat(client, clock, "p0", "d0", until=3.0)
    assert node(client, "p0").up and node(client, "d0").up
    beat(client, clock, "d0", until=3.0 + NODE_TIMEOUT_S - 0.01)  # p0 silent since 3.0
    assert node(client, "p0").up and client.live_node() is node(client, "d0")
    beat(client, clock, "d0", until=3.0 + NODE_TIMEOUT_S + 0.01)
    assert not node(client, "p0").up and client.live_node() is None
    client.record_stats(stats("p0", "prefill"))
    client.fail_dead_nodes()
    assert node(client, "p0").up and client.live_node() is node(client, "d0")


def test_heartbeats_of_another_process_do_not_keep_a_node_alive():
    client, clock, _ = cluster("c0")
    clock.now = 0.9
    client.registry.beat(Heartbeat("c0", "someone-else"))
    clock.now = 1.1
    assert client.live_node() is None


def test_a_request_lost_before_its_first_token_is_retried_on_the_other_prefill_node():
    client, clock, sockets = cluster("p0", "p1", "d0")
    queue = client.submit("r", [1, 2, 3], FOUR_TOKENS)
    first = generates(sockets["d0"])[0]
    lost = "p0" if first.prefill_address == "tcp://p0" else "p1"
    other = "p1" if lost == "p0" else "p0"
    beat(client, clock, other, "d0", until=NODE_TIMEOUT_S + 0.3)

    retry = generates(sockets["d0"])[-1]
    assert (retry.request_id, retry.prefill_address) == ("r~1", f"tcp://{other}")
    assert retry.prompt_token_ids == [1, 2, 3] and retry.sampling == FOUR_TOKENS
    assert aborts(sockets["d0"]) == ["r"] and aborts(sockets[lost]) == ["r"]
    client._dispatch(TokenBatch(lost, [TokenUpdate("r", [9], None, offset=0)]))  # too late
    client._dispatch(TokenBatch(other, [TokenUpdate("r~1", [5], None, offset=0)]))
    client._dispatch(TokenBatch("d0", [TokenUpdate("r~1", [6], "length", offset=1)]))
    delivered = drain(queue)
    assert [(u.request_id, u.token_ids) for u in delivered] == [("r", [5]), ("r", [6])]
    assert not client.inflight and client.num_waiting == 0


def test_a_request_is_never_retried_after_its_first_token_reached_the_client():
    client, clock, sockets = cluster("p0", "p1", "d0", "d1")
    queue = client.submit("r", [1, 2, 3], FOUR_TOKENS)
    decode_id = "d0" if generates(sockets["d0"]) else "d1"
    client._dispatch(TokenBatch("p", [TokenUpdate("r", [5], None, offset=0)]))
    client.shown("r")  # the generation passed its text on (router/generation.py)
    beat(client, clock, "p0", "p1", "d0", "d1", until=2.0)
    beat(client, clock, *{"p0", "p1", "d0", "d1"} - {decode_id}, until=2.0 + NODE_TIMEOUT_S + 0.3)

    update, failure = drain(queue)
    assert update.token_ids == [5]
    assert isinstance(failure, RequestFailed) and failure.status == 503
    assert f"decode node {decode_id}" in failure.message
    assert sum(len(generates(s)) for s in sockets.values()) == 1
    assert not client.inflight


@pytest.mark.parametrize(
    ("held_back", "read_before_the_loss"), [(True, True), (True, False), (False, False)]
)
def test_a_request_whose_output_has_not_reached_the_client_is_retried_and_shows_the_retry_alone(
    tokenizer, held_back, read_before_the_loss
):
    """Its first token's text held back (a stop string's start) and read, or not read yet when
    the loss comes: nothing reached the client, so the loss is retried, and the old attempt's
    token never shows (taken back, or dropped unread beside the retry's marker)."""
    old, *retried = tokenizer.encode("hello world", add_special_tokens=False)[:3]
    stop = [tokenizer.decode([old]) + "\u2603"] if held_back else []  # begun, never ended
    client, _, sockets = cluster("p0", "p1", "d0")
    plan = Plan([[1, 2, 3]], [SamplingParams(temperature=0.0, max_tokens=2)], stop)
    generation = Generation("cmpl-r", plan, client, tokenizer, RouterMetrics("tiny"))

    async def scenario() -> tuple[list, int]:
        generation.start()
        (choice,) = generation.choices
        wire = choice.request_id
        events = generation.events()
        reader = asyncio.create_task(anext(events))
        client._dispatch(TokenBatch("p", [TokenUpdate(wire, [old], None, offset=0)]))
        if read_before_the_loss:
            while not generation.queue.empty():
                await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert choice.num_tokens == 1 and not reader.done()
        client._dispatch(RequestFailed(wire, "KV transfer failed", 503))
        client._dispatch(TokenBatch("p", [TokenUpdate(f"{wire}~1", retried[:1], None, offset=0)]))
        client._dispatch(
            TokenBatch("d0", [TokenUpdate(f"{wire}~1", retried[1:], "length", offset=1)])
        )
        shown = [await reader] + [batch async for batch in events]
        return [e for batch in shown for e in batch], choice.num_tokens

    shown, num_tokens = asyncio.run(scenario())
    assert [g.request_id for g in generates(sockets["d0"])] == ["cmpl-r-0", "cmpl-r-0~1"]
    assert "".join(e.text for e in shown) == tokenizer.decode(retried)
    assert shown[-1].finish_reason == "length" and num_tokens == 2
    assert not client.inflight


def test_without_another_prefill_node_a_lost_request_fails_with_503():
    client, clock, sockets = cluster("p0", "d0")
    queue = client.submit("r", [1, 2, 3], FOUR_TOKENS)
    beat(client, clock, "d0", until=NODE_TIMEOUT_S + 0.3)
    (failure,) = drain(queue)
    assert isinstance(failure, RequestFailed) and failure.status == 503
    assert "prefill node p0 stopped responding" in failure.message
    assert aborts(sockets["d0"]) == ["r"] and len(generates(sockets["d0"])) == 1


def test_a_503_from_a_node_is_retried_a_bounded_number_of_times_and_a_400_is_not():
    client, _, sockets = cluster("p0", "p1", "d0", max_retries=2)
    queue = client.submit("r", [1, 2, 3], FOUR_TOKENS)
    for attempt in ("r", "r~1", "r~2"):
        client._dispatch(RequestFailed(attempt, f"KV transfer of {attempt} failed", 503))
    assert [g.request_id for g in generates(sockets["d0"])] == ["r", "r~1", "r~2"]
    prefills = [g.prefill_address for g in generates(sockets["d0"])]
    assert prefills[0] != prefills[1], "the retry went to the prefill node that failed it"
    (failure,) = drain(queue)
    assert failure.request_id == "r" and failure.message == "KV transfer of r~2 failed"

    queue = client.submit("s", [1, 2, 3], FOUR_TOKENS)
    client._dispatch(RequestFailed("s", "bad request", 400))
    (failure,) = drain(queue)
    assert failure.status == 400 and len(generates(sockets["d0"])) == 4


def test_a_restarted_node_loses_the_requests_its_previous_process_held():
    client, _, sockets = cluster("c0", "c1")
    queue = client.submit("r", [1, 2, 3], FOUR_TOKENS)
    served_by = "c0" if generates(sockets["c0"]) else "c1"
    client.record_stats(stats(served_by, "colocated", instance_id="i1"))
    assert generates(sockets["c0"])[-1].request_id == "r~1" or generates(sockets["c1"])[
        -1
    ].request_id == "r~1"
    assert aborts(sockets[served_by]) == ["r"]
    assert drain(queue) == [] and "r" in client.inflight
