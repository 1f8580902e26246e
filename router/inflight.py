"""One request in flight on the nodes, as the router's node client tracks it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from router.node_registry import NodeState
from wire.messages import Generate, TokenUpdate


@dataclass
class InFlight:
    """A request sent to `node` (decode or colocated), and to `prefill` in disaggregated mode.

    Updates are delivered to `queue` in output order: one arriving ahead of `next_offset` waits
    in `early` (the first token comes from the prefill node, the rest from the decode node).
    A retry (router/node_client.py) sends `request` again under a new `wire_id`, the id the
    nodes then know it by, avoiding the prefill nodes in `failed_prefills` when it can."""

    queue: asyncio.Queue
    node: NodeState
    prefill: NodeState | None = None
    queued_at: NodeState | None = None  # the node computing its prompt, until it starts
    started: bool = False  # whether any token (or failure) arrived yet
    next_offset: int = 0
    early: dict[int, TokenUpdate] = field(default_factory=dict)
    submitted_at: float = field(default_factory=time.monotonic)
    request: Generate | None = None
    wire_id: str | None = None
    attempts: int = 1
    failed_prefills: set[str] = field(default_factory=set)
