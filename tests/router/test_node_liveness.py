"""Slow is not dead, gone is gone: the router tells a node whose process exited (its connection
closed) from one that is only silent, with real ZeroMQ sockets on loopback.

A node process that exits closes the router's connection to it, and the node is down at the
next sweep whatever the node timeout, and up again once a process reconnects; a node that is
only silent stays up until the timeout.
"""

from __future__ import annotations

import time

import zmq

from pdserve.router.cluster.node_links import NodeLinks
from pdserve.router.cluster.node_registry import NodeRegistry
from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.free_ports import free_port
from pdserve.wire.messages import NodeStats
from tests.node_stats import node_stats


def stats(node_id: str = "d0") -> NodeStats:
    return node_stats(
        node_id=node_id, role="decode", num_running=1, num_free_blocks=100,
        num_total_blocks=100, instance_id="i0",
    )


def changes_until(links: NodeLinks, connected: bool, timeout_s: float = 30.0):
    """Connection changes up to and including the first to `connected`."""
    seen, deadline = [], time.monotonic() + timeout_s
    while not seen or seen[-1][1] != connected:
        assert time.monotonic() < deadline, f"no connection change to {connected}: {seen}"
        seen += links.connection_changes()
        time.sleep(0.01)
    return seen


def test_a_node_whose_connection_closes_is_down_at_once_whatever_the_timeout():
    now = [0.0]
    address = f"tcp://127.0.0.1:{free_port()}"
    registry = NodeRegistry([f"d0={address}"], 30.0, connect=lambda node: None, clock=lambda: now[0])
    links = NodeLinks(f"tcp://127.0.0.1:{free_port()}", ClusterAuth.none())
    context = zmq.Context()
    node_socket = context.socket(zmq.PULL)  # the node process's end
    node_socket.bind(address)
    try:
        links.open(registry.nodes)
        registry.record(stats())
        for node, connected in changes_until(links, connected=True):
            registry.connection_changed(node, connected)
        assert [n.node_id for n in registry.sweep()] == ["d0"]
        now[0] = 29.0  # silent, but its connection is open: still up
        assert registry.sweep() == [] and [n.node_id for n in registry.live()] == ["d0"]
        node_socket.close(linger=0)  # the process exits
        for node, connected in changes_until(links, connected=False):
            registry.connection_changed(node, connected)
        assert registry.live() == []
        (changed,) = registry.sweep()
        assert changed.node_id == "d0" and not changed.up
    finally:
        links.close(registry.nodes)
        node_socket.close(linger=0)
        context.term()


def test_a_closed_connection_takes_a_node_down_and_a_reopened_one_brings_it_back():
    registry = NodeRegistry(["d0=tcp://d0"], 30.0, connect=lambda node: None, clock=lambda: 0.0)
    (node,) = registry.nodes
    registry.record(stats())
    registry.sweep()
    registry.connection_changed(node, connected=False)
    (changed,) = registry.sweep()
    assert changed is node and not node.up
    registry.connection_changed(node, connected=True)  # a restarted process reconnects
    assert registry.sweep() == [node] and node.up
