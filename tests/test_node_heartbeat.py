"""The node loop's liveness and leak self-check, with a real node on real sockets (the test
plays the router): Heartbeats keep flowing while an engine step blocks the loop (even one that
holds the GIL), stop when the loop is wedged past its stall limit, and an idle node reports the
blocks it holds with no request as leaked."""

from __future__ import annotations

import itertools
import threading
import time

import zmq

from decode_node.colocated import ColocatedNode
from engine.protocol import Generate, Heartbeat, NodeStats, decode, encode
from pdserve.launcher import free_port

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

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.context.term()


def run_node(tiny_llama_dir, step_seconds: float, busy: bool, stall_limit_s: float = 120.0):
    """Starts a node whose first engine step takes `step_seconds` (busy-looping, holding the
    GIL, or sleeping), sends it a request, and returns every message until well after."""
    listen, router_address = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    config = {"model": str(tiny_llama_dir), "num_kv_blocks": 64}
    node = ColocatedNode(config, "hb", listen, router_address, heartbeat_interval=HEARTBEAT_S)
    node.stall_limit_s = stall_limit_s
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
        router.arrivals(1.0)
        router.push.send(encode(Generate("r", [5, 6, 7], {"max_tokens": 2})))
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
    config = {"model": str(tiny_llama_dir), "num_kv_blocks": 64}
    node = ColocatedNode(config, "leaky", listen, router_address, heartbeat_interval=HEARTBEAT_S)
    node.engine.reserve_blocks(40)  # three blocks held by nothing that will ever free them
    router = FakeRouter(listen, router_address)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        stats = [m for _, m in router.arrivals(1.5) if isinstance(m, NodeStats)]
    finally:
        node.stop()
        thread.join(timeout=10)
        router.close()
    assert stats[0].num_leaked_blocks == 0  # not checked yet
    assert stats[-1].num_leaked_blocks == 3
