"""The nodes the router knows: configured addresses, nodes that join by their heartbeat, roles,
liveness, and the pairing check.

A node is known from a configured address (`[ID=]tcp://host:port`, bound to the first
heartbeat that claims it) or from a heartbeat carrying a listen address the router has not
seen (a node started on another host joins this way). A heartbeat with a new instance id under
a known node id is a restarted node: `on_restart(node)` lets the caller drop what it had sent
the previous process. A restarted node that listens at another address (Ray placed it on
another host, or on another free port: commands/ray_process_actor.py) is followed there: its
old connection is closed (`disconnect`) and a new one made to the address it reports. These, and its role (colocated, prefill, decode), come from its
NodeStats' `identity`.

Liveness: slow is not dead. A node is down when its process is gone or when it has made no
progress for `node_timeout_s` (default 30 s), never because one heartbeat came late:
  - process gone: the router's connection to the node closed (`connection_changed`, from the
    socket monitor of router/cluster/node_links.py). A process that exits, however it dies, closes it
    at once, so a killed node is down within one watchdog round, whatever the timeout;
  - no progress: neither NodeStats nor Heartbeats (sent from a thread of their own every 0.5 s
    by default, during long engine steps too) arrived for `node_timeout_s`. The node stops its
    own heartbeats when its loop makes no progress for its stall limit (node/heartbeat.py), so
    a wedged step ends here too. A Heartbeat counts only from the process whose NodeStats were
    seen. 30 s: on a 2-core host kept at load 4-7 by other work, heartbeats due every 0.5 s
    arrived up to 1.25 s apart, and a node process paused for seconds (throttled, swapped)
    must not fail the streams it serves; a process that is really gone is caught by its
    connection long before.
`sweep()` notes each change of liveness (one log line each); the watchdog calls it on time and
skips a round that itself ran late (router/cluster/node_client.py): after a stall of the router's own
event loop, the heartbeats that queued meanwhile are read first (the socket takes one message
from each node in turn), so the router's stall is never blamed on its nodes.
`live()`, which routing and /health read between sweeps, counts a node whose connection is open
and that was heard within `node_timeout_s` or up at the last sweep: heartbeats that sat unread
while the router's own event loop was blocked (a busy machine, a burst of requests) never make
a healthy node look dead to the request routed in that moment.

Draining (router/cluster/node_drain.py): a node the launcher is taking out of service (to
give it another role) is `draining`: `live()` leaves it out, so it gets no new request, while
the requests it holds finish as usual (liveness, retries and aborts treat it like any node).
Once its process is stopped, `remove()` forgets it, and its id for good: a NodeStats or
Heartbeat of it that was still queued (or any later one under that id) is ignored, so a
removed node never joins again (node ids are never reused: commands/role_changer.py).

Pairing: the first node to report a model fingerprint sets the reference (fingerprint, dtype,
block size); a node that differs in any of them is refused, with a message naming both values,
and never receives a request. Prefill and decode nodes must also agree on their
`tensor_parallel_size` (each prefill rank writes its KV shard to the same decode rank): the
first of them sets it; colocated nodes move no KV and may differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.wire.messages import Heartbeat, NodeStats
from pdserve.wire.node_stats import NodeIdentity
from pdserve.wire.roles import Role

logger = logging.getLogger(__name__)

ROLES = tuple(Role)


@dataclass
class NodeState:
    """One node: its address and what its last NodeStats said."""

    address: str
    node_id: str | None = None
    stats: NodeStats | None = None
    last_seen: float = float("-inf")
    socket: Any = None
    refused: str | None = None
    up: bool = False  # liveness as of the last sweep()
    connection_lost: bool = False  # the router's connection to it closed and has not reopened
    promised_blocks: int = 0  # prompt blocks of requests sent since its last NodeStats
    draining: bool = False  # takes no new request (router/cluster/node_drain.py)

    @property
    def role(self) -> str | None:
        return self.stats.identity.role if self.stats is not None else None

    def alive(self, now: float, timeout_s: float) -> bool:
        return (
            self.stats is not None
            and self.refused is None
            and not self.connection_lost
            and now - self.last_seen <= timeout_s
        )


def parse_node_spec(spec: str) -> tuple[str | None, str]:
    """`ID=tcp://host:port` -> (ID, address); `tcp://host:port` -> (None, address)."""
    node_id, sep, address = spec.partition("=")
    if sep and "://" not in node_id:
        return node_id, address
    return None, spec


class NodeRegistry:
    def __init__(
        self,
        node_addresses: list[str],
        node_timeout_s: float,
        connect: Callable[[NodeState], None],
        clock: Callable[[], float],
        on_restart: Callable[[NodeState], None] | None = None,
        disconnect: Callable[[NodeState], None] = lambda node: None,
    ) -> None:
        self.nodes = [
            NodeState(address, node_id) for node_id, address in map(parse_node_spec, node_addresses)
        ]
        self.node_timeout_s = node_timeout_s
        self.connect = connect
        self.clock = clock
        self.on_restart = on_restart
        self.disconnect = disconnect
        self.removed: set[str] = set()  # ids of nodes removed for good
        self.reference: tuple[str, str, int] | None = None
        self.kv_shards_reference: int | None = None  # tensor_parallel_size of prefill/decode

    def live(self, role: str | None = None) -> list[NodeState]:
        """Nodes that take new requests: heard within the timeout, or up at the last sweep
        (module docstring), and not draining."""
        now = self.clock()
        return [
            n
            for n in self.nodes
            if (n.up or n.alive(now, self.node_timeout_s))
            and not n.connection_lost
            and not n.draining
            and (role is None or n.role == role)
        ]

    def find(self, node_id: str) -> NodeState | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def remove(self, node: NodeState) -> None:
        """Forgets a node retired for good (its process was stopped after a drain)."""
        self.nodes.remove(node)
        if node.node_id is not None:
            self.removed.add(node.node_id)
        logger.info("node %s (%s) removed", node.node_id, node.role)

    def connection_changed(self, node: NodeState, connected: bool) -> None:
        """The router's connection to `node` opened or closed (its process exited)."""
        if node.connection_lost == (not connected):
            return
        node.connection_lost = not connected
        if node.stats is not None:
            logger.log(
                logging.INFO if connected else logging.WARNING,
                "node %s (%s): its connection %s", node.node_id, node.role,
                "is open again" if connected else "closed (its process exited)",
            )

    def record(self, stats: NodeStats) -> NodeState | None:
        """Stores a node's heartbeat; registers a node that joins with its listen address."""
        identity = stats.identity
        if identity.node_id in self.removed:
            return None  # sent before its process stopped, read after it was removed
        node = self._find(identity)
        if node is None:
            logger.warning("stats from unknown node %r ignored", identity.node_id)
            return None
        if identity.role not in ROLES:
            logger.warning("node %s reports an unknown role %r", identity.node_id, identity.role)
            return None
        previous = node.stats
        if previous is None:
            node.refused = self._pairing_problem(identity)
            if node.refused:
                logger.error("refused node %s: %s", identity.node_id, node.refused)
            else:
                logger.info(
                    "node %s (%s) joined at %s", identity.node_id, identity.role, node.address
                )
        node.stats = stats
        node.last_seen = self.clock()
        node.promised_blocks = 0
        if previous is not None and previous.identity.instance_id != identity.instance_id:
            logger.warning("node %s (%s) was restarted", identity.node_id, identity.role)
            if identity.listen_address and identity.listen_address != node.address:
                self._move(node, identity.listen_address)
            if self.on_restart is not None:
                self.on_restart(node)
        return node

    def _move(self, node: NodeState, address: str) -> None:
        """Follows a restarted node to the address it listens at now (module docstring)."""
        logger.warning("node %s moved from %s to %s", node.node_id, node.address, address)
        self.disconnect(node)
        node.address = address
        node.connection_lost = False  # the new connection's own events say from here on
        self.connect(node)

    def sweep(self) -> list[NodeState]:
        """Updates every node's `up`; logs and returns the nodes whose liveness changed."""
        now = self.clock()
        changed = []
        for node in self.nodes:
            alive = node.alive(now, self.node_timeout_s)
            if alive == node.up:
                continue
            node.up = alive
            changed.append(node)
            if alive:
                logger.info("node %s (%s) is up", node.node_id, node.role)
            elif node.connection_lost:
                logger.warning("node %s (%s) is down: its process exited", node.node_id, node.role)
            else:
                silence = now - node.last_seen
                logger.warning(
                    "node %s (%s) is down: no heartbeat for %.1f s", node.node_id, node.role, silence
                )
        return changed

    def beat(self, heartbeat: Heartbeat) -> None:
        """A node process says it is alive (between its NodeStats)."""
        node = next((n for n in self.nodes if n.node_id == heartbeat.node_id), None)
        stats = node.stats if node is not None else None
        if stats is not None and stats.identity.instance_id == heartbeat.instance_id:
            node.last_seen = self.clock()

    def _find(self, identity: NodeIdentity) -> NodeState | None:
        node = next((n for n in self.nodes if n.node_id == identity.node_id), None)
        if node is not None:
            return node
        if identity.listen_address:
            node = next((n for n in self.nodes if n.address == identity.listen_address), None)
            if node is None:
                node = NodeState(identity.listen_address)
                self.connect(node)
                self.nodes.append(node)
        else:
            node = next((n for n in self.nodes if n.node_id is None), None)
        if node is not None:
            node.node_id = identity.node_id
        return node

    def _pairing_problem(self, identity: NodeIdentity) -> str | None:
        return self._model_problem(identity) or self._kv_shards_problem(identity)

    def _kv_shards_problem(self, identity: NodeIdentity) -> str | None:
        if identity.role == Role.COLOCATED:
            return None
        size = identity.tensor_parallel_size
        if self.kv_shards_reference is None:
            self.kv_shards_reference = size
            return None
        if size != self.kv_shards_reference:
            return (
                f"its tensor_parallel_size is {size} but the other prefill "
                f"and decode nodes have {self.kv_shards_reference}: each prefill rank writes its "
                "KV shard to the same decode rank"
            )
        return None

    def _model_problem(self, identity: NodeIdentity) -> str | None:
        if not identity.model_fingerprint:
            return None
        mine = (identity.model_fingerprint, identity.dtype, identity.block_size)
        if self.reference is None:
            self.reference = mine
            return None
        names = ("model fingerprint", "KV dtype", "block size")
        for name, theirs, expected in zip(names, mine, self.reference):
            if theirs != expected:
                return f"its {name} is {theirs!r} but the other nodes have {expected!r}"
        return None
