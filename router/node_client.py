"""Async ZeroMQ client for the nodes: sends Generate/Abort, receives tokens and stats.

One PUSH socket per node address (a plain, non-blocking zmq socket, so `abort` is a plain
call that works even inside a cancelled task's `finally`), one PULL socket bound at the
router's listen address (zmq.asyncio), and two tasks: the receiver, which dispatches every
TokenUpdate and RequestFailed to the queue of its request and records each node's NodeStats
(its heartbeat), and the watchdog, which fails the in-flight requests of a node that stopped
sending stats with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from engine.protocol import (
    Abort,
    Generate,
    NodeStats,
    ProtocolError,
    RequestFailed,
    TokenBatch,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.25


@dataclass
class NodeState:
    """One configured node: its address and what its last NodeStats said."""

    address: str
    node_id: str | None = None
    stats: NodeStats | None = None
    last_seen: float = float("-inf")
    socket: Any = None

    def alive(self, now: float, timeout_s: float) -> bool:
        return self.stats is not None and now - self.last_seen <= timeout_s


@dataclass
class InFlight:
    queue: asyncio.Queue
    node: NodeState
    started: bool = False  # whether any token (or failure) arrived yet
    submitted_at: float = field(default_factory=time.monotonic)


def parse_node_spec(spec: str) -> tuple[str | None, str]:
    """`ID=tcp://host:port` -> (ID, address); `tcp://host:port` -> (None, address)."""
    node_id, sep, address = spec.partition("=")
    if sep and "://" not in node_id:
        return node_id, address
    return None, spec


def pick_node(nodes: list[NodeState], now: float, timeout_s: float) -> NodeState | None:
    """The live node with the most free KV-cache blocks, or None if none is alive."""
    live = [n for n in nodes if n.alive(now, timeout_s)]
    return max(live, key=lambda n: n.stats.num_free_blocks, default=None)


class NodeClient:
    def __init__(
        self,
        node_addresses: list[str],
        listen_address: str,
        node_timeout_s: float = 30.0,
        on_stats: Callable[[NodeState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nodes = [
            NodeState(address, node_id) for node_id, address in map(parse_node_spec, node_addresses)
        ]
        self.listen_address = listen_address
        self.node_timeout_s = node_timeout_s
        self.on_stats = on_stats
        self.clock = clock
        self.inflight: dict[str, InFlight] = {}
        self._sync_context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._async_context = zmq.asyncio.Context()
        self._pull = self._async_context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.listen_address)
        self._sync_context = zmq.Context()
        for node in self.nodes:
            node.socket = self._sync_context.socket(zmq.PUSH)
            node.socket.setsockopt(zmq.LINGER, 0)
            node.socket.setsockopt(zmq.SNDHWM, 100_000)
            node.socket.connect(node.address)
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="node-client-receive"),
            asyncio.create_task(self._watchdog_loop(), name="node-client-watchdog"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        for request_id in list(self.inflight):
            self.abort(request_id)
        for node in self.nodes:
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

    # -- state -------------------------------------------------------------------------------

    def live_node(self) -> NodeState | None:
        return pick_node(self.nodes, self.clock(), self.node_timeout_s)

    def any_alive(self) -> bool:
        return self.live_node() is not None

    @property
    def num_waiting(self) -> int:
        """Requests submitted that have not produced a token yet."""
        return sum(1 for entry in self.inflight.values() if not entry.started)

    def record_stats(self, stats: NodeStats) -> NodeState | None:
        """Stores a node's stats (its heartbeat); also used by tests to inject a live node."""
        node = next((n for n in self.nodes if n.node_id == stats.node_id), None)
        if node is None:  # an unnamed address: bind the first one not yet claimed
            node = next((n for n in self.nodes if n.node_id is None), None)
            if node is None:
                logger.warning("stats from unknown node %r ignored", stats.node_id)
                return None
            node.node_id = stats.node_id
        node.stats = stats
        node.last_seen = self.clock()
        if self.on_stats is not None:
            self.on_stats(node)
        return node

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        queue: asyncio.Queue | None = None,
    ) -> asyncio.Queue:
        """Sends Generate to the best live node; updates arrive on the returned queue (pass
        one queue for several requests to read them merged). Raises LookupError when no node
        is alive and RuntimeError when the node's socket cannot take the message."""
        node = self.live_node()
        if node is None:
            raise LookupError("no live node")
        if request_id in self.inflight:
            raise ValueError(f"request id {request_id!r} is in use")
        queue = queue if queue is not None else asyncio.Queue()
        try:
            node.socket.send(encode(Generate(request_id, prompt_ids, sampling)), zmq.NOBLOCK)
        except zmq.Again:
            raise RuntimeError("the node is not accepting requests") from None
        self.inflight[request_id] = InFlight(queue, node, submitted_at=self.clock())
        return queue

    def abort(self, request_id: str) -> None:
        """Forgets the request and tells its node to drop it (never blocks, never raises)."""
        entry = self.inflight.pop(request_id, None)
        if entry is None or entry.node.socket is None:
            return
        try:
            entry.node.socket.send(encode(Abort(request_id)), zmq.NOBLOCK)
        except zmq.ZMQError as error:
            logger.warning("could not send Abort for %s: %s", request_id, error)

    # -- tasks -------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                message = decode(data)
            except ProtocolError as error:
                logger.warning("dropped a malformed message (%d bytes): %s", len(data), error)
                continue
            try:
                self._dispatch(message)
            except Exception:  # one bad message must not stop the receiver
                logger.exception("failed to dispatch a %s message", type(message).__name__)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, NodeStats):
            self.record_stats(message)
        elif isinstance(message, TokenBatch):
            for update in message.updates:
                entry = self.inflight.get(update.request_id)
                if entry is None:
                    continue  # aborted or unknown
                entry.started = True
                if update.finish_reason is not None:
                    del self.inflight[update.request_id]
                entry.queue.put_nowait(update)
        elif isinstance(message, RequestFailed):
            entry = self.inflight.pop(message.request_id, None)
            if entry is not None:
                entry.queue.put_nowait(message)
        else:
            logger.warning("dropped an unexpected %s message", type(message).__name__)

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.fail_dead_nodes()

    def fail_dead_nodes(self) -> None:
        """Fails (503) every in-flight request whose node stopped sending stats."""
        now = self.clock()
        for request_id, entry in list(self.inflight.items()):
            if not entry.node.alive(now, self.node_timeout_s):
                del self.inflight[request_id]
                entry.queue.put_nowait(
                    RequestFailed(request_id, "the node serving this request stopped", 503)
                )
