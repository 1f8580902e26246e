"""Draining one node: the router stops placing new requests on it while it finishes those it
holds, says when it is empty, and forgets it once its process is stopped.

The launcher's run-time planner (commands/role_planner.py) drives it through the admin routes
(router/api/admin.py) when it gives a node another role. Lifecycle of a node here:

  serving    the usual: routing may pick it (router/cluster/routing.py, prefill_placement.py).
  draining   `drain()`: `NodeState.draining` is set, so the registry's `live()` leaves it out
             and no new request (nor a retry) goes to it. The requests it holds go on as
             usual: a decode node decodes them to their end, a prefill node computes the
             prompts it has and ships their KV. No deadline here: the launcher bounds the wait
             (`--planner-drain-timeout`) and `resume()`s the node when it passes.
  empty      still draining, and nothing is left on it: no request the router tracks needs it
             (as its decode or colocated node, or as its prefill node before the first token),
             and the node's own latest NodeStats report nothing waiting or running.
  resumed    `resume()`: serving again (the planner gave up, or changed its mind).
  removed    `remove()`, once the launcher has stopped its process: the registry, the links,
             the prefix index, the prompt queues and the metrics forget it. Only an empty node
             may be removed, so no request is lost by it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

from pdserve.router.cluster.node_client import NodeClient
from pdserve.router.cluster.node_registry import NodeState
from pdserve.router.errors import APIError

logger = logging.getLogger(__name__)


class DrainState(enum.StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    EMPTY = "empty"


class NodeDrains:
    """`on_removed(name)`: a node was removed (its metrics go)."""

    def __init__(self, client: NodeClient, on_removed: Callable[[str], None]) -> None:
        self.client = client
        self.on_removed = on_removed

    def node(self, node_id: str) -> NodeState:
        """APIError 404 for a node the router does not know."""
        node = self.client.registry.find(node_id)
        if node is None:
            raise APIError(404, f"No node {node_id!r} is known to the router.")
        return node

    def describe(self, node: NodeState) -> dict[str, Any]:
        """What the launcher's planner reads of a node (router/api/admin.py): role, liveness,
        drain state, the requests the router has on it, the node's own queue and KV blocks,
        and the predicted queue delay of a prompt it would compute (queue_delay.py; 0 when
        its queue is empty)."""
        client, stats = self.client, node.stats
        now = client.clock()
        delay = client.prompt_queues.delay(node, 0, now)
        live = not node.connection_lost and (
            node.up or node.alive(now, client.registry.node_timeout_s)
        )
        return {
            "node_id": node.node_id,
            "role": node.role,
            "address": node.address,
            "live": live,
            "state": self.state(node).value,
            "held": self.held(node),
            "num_waiting": stats.scheduling.num_waiting if stats else 0,
            "num_running": stats.scheduling.num_running if stats else 0,
            "kv_free_blocks": stats.kv.num_free_blocks if stats else 0,
            "kv_total_blocks": stats.kv.num_total_blocks if stats else 0,
            "queue_delay_s": delay.seconds if delay is not None else 0.0,
        }

    def held(self, node: NodeState) -> int:
        """Requests the router tracks that still need `node`."""
        return sum(
            1
            for _, entry in self.client.inflight.items()
            if entry.node is node or (entry.prefill is node and not entry.started)
        )

    def state(self, node: NodeState) -> DrainState:
        if not node.draining:
            return DrainState.SERVING
        scheduling = node.stats.scheduling if node.stats is not None else None
        busy = scheduling is not None and (scheduling.num_waiting or scheduling.num_running)
        return DrainState.DRAINING if busy or self.held(node) else DrainState.EMPTY

    def drain(self, node_id: str) -> DrainState:
        node = self.node(node_id)
        if not node.draining:
            node.draining = True
            logger.warning(
                "node %s (%s): draining, %d requests held; new requests go elsewhere",
                node_id, node.role, self.held(node),
            )
        return self.state(node)

    def resume(self, node_id: str) -> DrainState:
        node = self.node(node_id)
        if node.draining:
            node.draining = False
            logger.warning("node %s (%s): serving again", node_id, node.role)
        return self.state(node)

    def remove(self, node_id: str) -> None:
        """Forgets an empty node whose process the launcher stopped; APIError 409 for a node
        that is not empty (it would lose requests)."""
        node = self.node(node_id)
        state = self.state(node)
        if state is not DrainState.EMPTY:
            raise APIError(409, f"Node {node_id!r} is {state}, not empty: drain it first.")
        client = self.client
        client.links.disconnect(node)
        client.prefill_router.forget(node)
        client.prompt_queues.forget(node)
        client.registry.remove(node)
        self.on_removed(node_id)
