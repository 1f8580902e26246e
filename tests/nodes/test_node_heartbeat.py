"""The node loop's liveness and leak self-check, with a real node on real sockets (the test
plays the router): Heartbeats keep flowing while an engine step blocks the loop (even one that
holds the GIL), stop when the loop is wedged past its stall limit, a node announces itself only
once its warm-up forward is done, and an idle node reports the blocks it holds with no request
as leaked. On the router's side, a node is not called dead for heartbeats the router had no
chance to read (its own event loop stalled)."""

from __future__ import annotations

import itertools
import threading
import time

import zmq

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.colocated import ColocatedNode
from pdserve.node.config import NodeConfig
from pdserve.router.cluster.node_registry import NodeRegistry
from pdserve.wire.free_ports import free_port
from pdserve.wire.messages import Generate, Heartbeat, NodeStats, decode, encode
from pdserve.wire.sampling_params import SamplingParams
from tests.node_stats import node_stats

HEARTBEAT_S = 0.25


class FakeRouter:
    def __init__(self, listen: str, router: str) -> None:
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.bind(router)
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect(listen)

    def arrivals(self, seconds: float) -> list[tuple[float, object]]:
        """Every message of the next `seconds`, with its arrival time."""
        out, end = [], time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.pull.poll(int(left * 1000) + 1):
                out.append((time.monotonic(), decode(self.pull.recv())))
        return out

    def arrivals_until(self, predicate, timeout: float = 60.0) -> list[tuple[float, object]]:
        """Every message up to and including the first that satisfies `predicate`."""
        out, end = [], time.monotonic() + timeout
        while not (out and predicate(out[-1][1])):
            left = end - time.monotonic()
            assert left > 0, f"no such message within {timeout} s: {out[-3:]}"
            if self.pull.poll(int(left * 1000) + 1):
                out.append((time.monotonic(), decode(self.pull.recv())))
        return out

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.context.term()


def colocated_node(
    tiny_llama_dir, node_id: str, listen: str, router_address: str, stall_limit_s: float = 120.0
) -> ColocatedNode:
    return ColocatedNode(
        engine_config=EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64),
        config=NodeConfig(
            node_id=node_id,
            listen_address=listen,
            router_address=router_address,
            heartbeat_interval=HEARTBEAT_S,
            stall_limit_s=stall_limit_s,
        ),
    )


def run_node(tiny_llama_dir, step_seconds: float, busy: bool, stall_limit_s: float = 120.0):
    """Starts a node whose first engine step takes `step_seconds` (busy-looping, holding the
    GIL, or sleeping), sends it a request, and returns every message until well after."""
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    node = colocated_node(tiny_llama_dir, "hb", listen, router_address, stall_limit_s)
    real_step, calls = node.engine.step, []

    def slow_step():
        calls.append(time.monotonic())
        if len(calls) == 1:
            end = time.monotonic() + step_seconds
            while time.monotonic() < end:
                if not busy:
                    time.sleep(0.01)
        return real_step()

    node.engine.step = slow_step
    router = FakeRouter(listen, router_address)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        router.arrivals_until(lambda m: isinstance(m, NodeStats))  # the node is up
        router.push.send(encode(Generate("r", [5, 6, 7], SamplingParams(max_tokens=2))))
        messages = router.arrivals(step_seconds + 2.0)
    finally:
        node.stop()
        thread.join(timeout=10)
        router.close()
    assert not thread.is_alive()
    return calls[0], messages


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_heartbeats_keep_flowing_while_an_engine_step_holds_the_loop(tiny_llama_dir):
    step_started, messages = run_node(tiny_llama_dir, 2.0, busy=True)
    during = [t for t, m in messages if isinstance(m, Heartbeat) and t < step_started + 2.0]
    stats = [t for t, m in messages if isinstance(m, NodeStats)]
    assert min(stats) > step_started + 1.5, "the step did not block the loop: nothing was tested"
    # The router calls a node dead after two intervals; 0.1 s of slack for a loaded machine.
    assert len(during) >= 5 and max(gaps(during)) < 2 * HEARTBEAT_S + 0.1, gaps(during)
    assert all(m.node_id == "hb" for _, m in messages if isinstance(m, Heartbeat))


def test_a_wedged_node_loop_stops_heartbeating_until_it_moves_again(tiny_llama_dir):
    step_started, messages = run_node(tiny_llama_dir, 3.0, busy=False, stall_limit_s=1.0)
    beats = [t for t, m in messages if isinstance(m, Heartbeat)]
    assert max(gaps(beats)) >= 1.5, gaps(beats)
    assert any(t > step_started + 3.0 for t in beats), "heartbeats did not resume"


def test_an_idle_node_reports_blocks_held_without_a_request_as_leaked(tiny_llama_dir):
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    node = colocated_node(tiny_llama_dir, "leaky", listen, router_address)
    node.engine.reserve_blocks(40)  # three blocks held by nothing that will ever free them
    router = FakeRouter(listen, router_address)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        messages = router.arrivals_until(
            lambda m: isinstance(m, NodeStats) and m.kv.num_leaked_blocks > 0
        )
        stats = [m for _, m in messages if isinstance(m, NodeStats)]
    finally:
        node.stop()
        thread.join(timeout=10)
        router.close()
    assert stats[0].kv.num_leaked_blocks == 0  # not checked yet
    assert stats[-1].kv.num_leaked_blocks == 3


def test_a_node_announces_itself_only_once_its_warm_up_forward_is_done(tiny_llama_dir, monkeypatch):
    """A slow first forward (kernel JIT compilation) is paid before the router hears the node,
    so it can never count as missed heartbeats of a registered node."""
    warm_up, warmed_at = LLMEngine.warm_up, []

    def slow_warm_up(engine, *args, **kwargs):
        time.sleep(1.5)
        warm_up(engine, *args, **kwargs)
        warmed_at.append(time.monotonic())

    monkeypatch.setattr(LLMEngine, "warm_up", slow_warm_up)
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    node = colocated_node(tiny_llama_dir, "warm", listen, router_address)
    router = FakeRouter(listen, router_address)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        messages = router.arrivals_until(lambda m: isinstance(m, Heartbeat))
    finally:
        node.stop()
        thread.join(timeout=10)
        router.close()
    assert warmed_at, "the node never warmed up"
    assert isinstance(messages[0][1], NodeStats) and messages[0][0] > warmed_at[0], messages[:2]
    beats = [t for t, m in messages if isinstance(m, Heartbeat)]
    assert beats and max(gaps([messages[0][0], *beats])) < 2 * HEARTBEAT_S + 0.1, messages


def test_a_router_stalled_past_the_node_timeout_does_not_call_its_nodes_dead():
    """Heartbeats that sat unread while the router's event loop was blocked do not make a live
    node unroutable; a node that really is silent is down at the next sweep on time."""
    now = [0.0]
    registry = NodeRegistry(["p0=tcp://p0"], 1.0, connect=lambda node: None, clock=lambda: now[0])
    registry.record(node_stats(node_id="p0", role="prefill", num_running=1, instance_id="i0"))
    registry.sweep()
    now[0] = 1.6  # the router was stalled: the heartbeats of 0.5 s, 1.0 s and 1.5 s sit unread
    assert [n.node_id for n in registry.live()] == ["p0"]
    registry.beat(Heartbeat("p0", "i0"))  # read once the loop runs again
    assert registry.sweep() == [] and [n.node_id for n in registry.live()] == ["p0"]
    now[0] = 2.7  # then silent for longer than the timeout, and the sweep ran on time
    (changed,) = registry.sweep()
    assert not changed.up and registry.live() == []
