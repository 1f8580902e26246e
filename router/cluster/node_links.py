"""The router's ZeroMQ links to the nodes: a PUSH socket to each node, one PULL socket back.

Each node known to the registry gets a PUSH socket (`NodeState.socket`): a plain, non-blocking
zmq socket, so an Abort is a plain call that works even inside a cancelled task's `finally`.
A monitor on that socket reports its TCP connection to the node opening and closing
(`connection_changes()`): a node process that exits, killed or not, closes it at once, which is
how the router tells a dead node from a slow one (router/cluster/node_registry.py).
Everything the nodes send (token batches, failures, stats, heartbeats) arrives on one PULL
socket bound at the router's listen address (zmq.asyncio); `receive()` hands over its raw
frames, and the node client decodes them.

Who calls what: the node client `open()`s the links at start and `close()`s them at stop; the
node registry `connect()`s a node that joins while they are open; the node client `send()`s a
Generate (which raises when the node's socket cannot take it) and `send_abort()`s (which
never raises); the node drain (router/cluster/node_drain.py) `disconnect()`s a node retired
for good.

With a cluster secret (`cluster_auth`, wire/cluster_auth.py) the PULL socket is a CURVE
server and every PUSH a CURVE client: a node without the secret can neither send nor be sent to.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from pdserve.router.cluster.node_registry import NodeState
from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.messages import Abort, Generate, encode

logger = logging.getLogger(__name__)

SEND_HIGH_WATER_MARK = 100_000
CONNECTION_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class NodeLinks:
    def __init__(self, listen_address: str, cluster_auth: ClusterAuth) -> None:
        self.listen_address = listen_address
        self.cluster_auth = cluster_auth
        self._sync_context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._monitors: dict[int, tuple[NodeState, zmq.Socket]] = {}  # by id(node)

    def open(self, nodes: list[NodeState]) -> None:
        """Binds the PULL socket and connects a PUSH socket to each of `nodes`."""
        self._async_context = zmq.asyncio.Context()
        self._pull = self.cluster_auth.secure_server(self._async_context.socket(zmq.PULL))
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.listen_address)
        self._sync_context = zmq.Context()
        for node in nodes:
            self.connect(node)

    def connect(self, node: NodeState) -> None:
        """Gives `node` its PUSH socket; before `open()`, nothing (open() connects it then)."""
        if self._sync_context is None:
            return
        node.socket = self.cluster_auth.secure_client(self._sync_context.socket(zmq.PUSH))
        node.socket.setsockopt(zmq.LINGER, 0)
        node.socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._monitors[id(node)] = (node, node.socket.get_monitor_socket(CONNECTION_EVENTS))
        node.socket.connect(node.address)

    def connection_changes(self) -> list[tuple[NodeState, bool]]:
        """(node, connected) for each connection to a node that opened or closed since the last
        call, in the order they happened; never blocks."""
        changes = []
        for node, monitor in self._monitors.values():
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                changes.append((node, event == zmq.EVENT_CONNECTED))
        return changes

    def disconnect(self, node: NodeState) -> None:
        """Closes `node`'s PUSH socket and its monitor: the node is retired for good."""
        watched = self._monitors.pop(id(node), None)
        if watched is not None and node.socket is not None:
            node.socket.disable_monitor()
        if watched is not None:
            watched[1].close(linger=0)
        if node.socket is not None:
            node.socket.close(linger=0)
            node.socket = None

    def close(self, nodes: list[NodeState]) -> None:
        for node, monitor in self._monitors.values():
            if node.socket is not None:
                node.socket.disable_monitor()
            monitor.close(linger=0)
        self._monitors.clear()
        for node in nodes:
            if node.socket is not None:
                node.socket.close(linger=0)
                node.socket = None
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        for context in (self._sync_context, self._async_context):
            if context is not None:
                context.term()
        self._sync_context = self._async_context = None

    async def receive(self) -> bytes:
        """The next message from any node, undecoded."""
        return await self._pull.recv()

    def send(self, node: NodeState, message: Generate) -> None:
        """Raises RuntimeError when the node's socket cannot take the message now."""
        try:
            node.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise RuntimeError("the node is not accepting requests") from None

    def send_abort(self, wire_id: str, *nodes: NodeState | None) -> None:
        """Tells each of `nodes` (None entries skipped) to drop `wire_id`; never blocks or
        raises."""
        for node in nodes:
            if node is None or node.socket is None:
                continue
            try:
                node.socket.send(encode(Abort(wire_id)), zmq.NOBLOCK)
            except zmq.ZMQError as error:
                logger.warning("could not send Abort for %s: %s", wire_id, error)
