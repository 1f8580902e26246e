"""Nodes driven by a test instead of their loop: built with addresses nothing binds, their
outgoing messages kept in `node.sent` for the test to hand on."""

from __future__ import annotations

from pdserve.node.config import NodeConfig


def unlooped_config(node_id: str, **kv_settings) -> NodeConfig:
    """A NodeConfig whose addresses are never bound: the node loop does not run."""
    return NodeConfig(
        node_id=node_id,
        listen_address="tcp://127.0.0.1:1",
        router_address="tcp://127.0.0.1:2",
        **kv_settings,
    )


def capture_sends(node) -> None:
    """Keeps what the node sends, to the router or to a peer, in `node.sent`."""
    node.sent = []
    node.send = lambda message, address=None: node.sent.append(message)
