"""Async ZeroMQ client for the nodes: sends Generate/Abort, receives tokens and stats.

One PUSH socket per node address (a plain, non-blocking zmq socket, so `abort` is a plain
call that works even inside a cancelled task's `finally`), one PULL socket bound at the
router's listen address (zmq.asyncio), and two tasks: the receiver, which dispatches every
TokenUpdate (in output order) and RequestFailed to the queue of its request and records each
node's NodeStats (its heartbeat, see node_registry.py), and the watchdog, which fails with a
503 the in-flight requests of a node that stopped sending stats.

With live decode nodes a request is disaggregated: Generate goes to a decode node (routing.py)
naming the prefill node that computes the prompt; aborts go to both. Otherwise a colocated
node serves it.
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
    TokenUpdate,
    decode,
    encode,
)
from router.node_registry import NodeRegistry, NodeState
from router.routing import PrefillRouter, pick_decode_node

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.25


@dataclass
class InFlight:
    """A request sent to `node` (decode or colocated), and to `prefill` in disaggregated mode.

    Updates are delivered to `queue` in output order: one arriving ahead of `next_offset` waits
    in `early` (the first token comes from the prefill node, the rest from the decode node)."""

    queue: asyncio.Queue
    node: NodeState
    prefill: NodeState | None = None
    queued_tokens: int = 0
    started: bool = False  # whether any token (or failure) arrived yet
    next_offset: int = 0
    early: dict[int, TokenUpdate] = field(default_factory=dict)
    submitted_at: float = field(default_factory=time.monotonic)


class NodeClient:
    def __init__(
        self,
        node_addresses: list[str],
        listen_address: str,
        node_timeout_s: float = 30.0,
        on_stats: Callable[[NodeState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_router: PrefillRouter | None = None,
    ) -> None:
        self.registry = NodeRegistry(node_addresses, node_timeout_s, self._connect, clock)
        self.listen_address = listen_address
        self.node_timeout_s = node_timeout_s
        self.on_stats = on_stats
        self.clock = clock
        self.prefill_router = prefill_router or PrefillRouter()
        self.inflight: dict[str, InFlight] = {}
        self._sync_context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def nodes(self) -> list[NodeState]:
        return self.registry.nodes

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._async_context = zmq.asyncio.Context()
        self._pull = self._async_context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.listen_address)
        self._sync_context = zmq.Context()
        for node in self.nodes:
            self._connect(node)
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="node-client-receive"),
            asyncio.create_task(self._watchdog_loop(), name="node-client-watchdog"),
        ]

    def _connect(self, node: NodeState) -> None:
        if self._sync_context is None:
            return
        node.socket = self._sync_context.socket(zmq.PUSH)
        node.socket.setsockopt(zmq.LINGER, 0)
        node.socket.setsockopt(zmq.SNDHWM, 100_000)
        node.socket.connect(node.address)

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
        """A node that can serve a request now: a decode node when a prefill node is alive
        too (disaggregated), else a colocated node; None when neither is."""
        if self.registry.live("prefill"):
            decode_node = pick_decode_node(self.registry.live("decode"))
            if decode_node is not None:
                return decode_node
        return pick_decode_node(self.registry.live("colocated"))

    def any_alive(self) -> bool:
        return self.live_node() is not None

    @property
    def num_waiting(self) -> int:
        """Requests submitted that have not produced a token yet."""
        return sum(1 for entry in self.inflight.values() if not entry.started)

    def record_stats(self, stats: NodeStats) -> NodeState | None:
        """Stores a node's stats (its heartbeat); also used by tests to inject a live node."""
        node = self.registry.record(stats)
        if node is not None and self.on_stats is not None:
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
        entry = InFlight(queue if queue is not None else asyncio.Queue(), node)
        message = Generate(request_id, prompt_ids, sampling)
        if node.role == "decode":
            entry.prefill, cached = self.prefill_router.pick(
                self.registry.live("prefill"), prompt_ids
            )
            entry.queued_tokens = len(prompt_ids) - cached
            message.prefill_address = entry.prefill.address
        try:
            node.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise RuntimeError("the node is not accepting requests") from None
        if entry.prefill is not None:
            self.prefill_router.queue(entry.prefill, entry.queued_tokens)
        entry.submitted_at = self.clock()
        self.inflight[request_id] = entry
        return entry.queue

    def abort(self, request_id: str) -> None:
        """Forgets the request and tells its nodes to drop it (never blocks, never raises)."""
        entry = self._forget(request_id)
        if entry is None:
            return
        for node in (entry.node, entry.prefill):
            if node is None or node.socket is None:
                continue
            try:
                node.socket.send(encode(Abort(request_id)), zmq.NOBLOCK)
            except zmq.ZMQError as error:
                logger.warning("could not send Abort for %s: %s", request_id, error)

    def _forget(self, request_id: str) -> InFlight | None:
        entry = self.inflight.pop(request_id, None)
        if entry is not None:
            self._started(entry)
        return entry

    def _started(self, entry: InFlight) -> None:
        if not entry.started:
            entry.started = True
            if entry.prefill is not None:
                self.prefill_router.dequeue(entry.prefill, entry.queued_tokens)

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
                self._deliver_in_order(update)
        elif isinstance(message, RequestFailed):
            entry = self._forget(message.request_id)
            if entry is not None:
                entry.queue.put_nowait(message)
        else:
            logger.warning("dropped an unexpected %s message", type(message).__name__)

    def _deliver_in_order(self, update: TokenUpdate) -> None:
        entry = self.inflight.get(update.request_id)
        if entry is None or update.offset < entry.next_offset:
            return  # aborted, unknown, or already delivered
        entry.early[update.offset] = update
        while entry.next_offset in entry.early:
            ready = entry.early.pop(entry.next_offset)
            self._started(entry)
            entry.next_offset += len(ready.token_ids)
            entry.queue.put_nowait(ready)
            if ready.finish_reason is not None:
                del self.inflight[update.request_id]
                return

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.fail_dead_nodes()

    def fail_dead_nodes(self) -> None:
        """Fails (503) every in-flight request whose node stopped sending stats (for its
        prefill node: before the first token came back)."""
        now = self.clock()
        for request_id, entry in list(self.inflight.items()):
            prefill_lost = (
                entry.prefill is not None
                and not entry.started
                and not entry.prefill.alive(now, self.node_timeout_s)
            )
            if prefill_lost or not entry.node.alive(now, self.node_timeout_s):
                self.abort(request_id)
                entry.queue.put_nowait(
                    RequestFailed(request_id, "a node serving this request stopped", 503)
                )
