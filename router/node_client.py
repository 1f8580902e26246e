"""Async ZeroMQ client for the nodes: sends Generate/Abort, receives tokens and stats.

One PUSH socket per node address (a plain, non-blocking zmq socket, so `abort` is a plain
call that works even inside a cancelled task's `finally`), one PULL socket bound at the
router's listen address (zmq.asyncio), and two tasks: the receiver, which dispatches every
TokenUpdate (in output order) and RequestFailed to the queue of its request and records each
node's NodeStats (its heartbeat, see node_registry.py), and the watchdog, which every
WATCHDOG_INTERVAL_S notes the nodes that went down or came back, and hands every in-flight
request that lost a node to the retry policy. A watchdog round that itself ran late (the
router's event loop was stalled, so heartbeats may be sitting unread) judges nothing.

With live decode nodes a request is disaggregated: Generate goes to a decode node (routing.py)
naming the prefill node that computes the prompt; aborts go to both. Otherwise a colocated
node serves it.

Early refusal: a new request whose prompt would wait longer than `max_queue_delay_s` at the
node that computes it (router/queue_delay.py) is refused with 429 before anything is sent.

Retry policy: a request is lost when its decode (or colocated) node goes down or restarts,
when its prefill node does so before the first token came back, or when a node answers
RequestFailed 503 (a KV transfer failed or timed out, no KV blocks in time). While no token of
it has reached the client, a lost request is aborted on its nodes and sent again under a new
node-side id (`<id>~<attempt>`, so nothing of the old attempt can be mistaken for the new) to
live nodes, preferring a prefill node it has not failed on, at most `max_retries` times. Once a
token has reached the client it is never retried: it fails with 503, which the client sees as
an error event ending its stream.

With a cluster secret (`cluster_auth`, wire/cluster_auth.py) the PULL socket is a CURVE
server and every PUSH a CURVE client: a node without the secret can neither send nor be sent to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from router.errors import APIError
from router.inflight import InFlight
from router.node_registry import NodeRegistry, NodeState
from router.queue_delay import PromptQueues
from router.routing import PrefillRouter, pick_decode_node
from wire.cluster_auth import ClusterAuth
from wire.messages import (
    Abort,
    Generate,
    Heartbeat,
    NodeStats,
    ProtocolError,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.25


class NodeClient:
    def __init__(
        self,
        node_addresses: list[str],
        listen_address: str,
        node_timeout_s: float = 30.0,
        on_stats: Callable[[NodeState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_router: PrefillRouter | None = None,
        max_retries: int = 2,
        on_liveness: Callable[[NodeState], None] | None = None,
        on_retry: Callable[[], None] | None = None,
        cluster_auth: ClusterAuth | None = None,
        max_queue_delay_s: float | None = None,
    ) -> None:
        self.cluster_auth = cluster_auth or ClusterAuth.none()
        self.registry = NodeRegistry(
            node_addresses, node_timeout_s, self._connect, clock, on_restart=self._on_restart
        )
        self.listen_address = listen_address
        self.node_timeout_s = node_timeout_s
        self.on_stats = on_stats
        self.on_liveness = on_liveness
        self.on_retry = on_retry
        self.clock = clock
        self.prompt_queues = PromptQueues()
        self.prefill_router = prefill_router or PrefillRouter(self.prompt_queues)
        self.max_queue_delay_s = max_queue_delay_s
        self.max_retries = max_retries
        self.inflight: dict[str, InFlight] = {}
        self._client_ids: dict[str, str] = {}  # a retry's node-side id -> the request's id
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
        self._pull = self.cluster_auth.secure_server(self._async_context.socket(zmq.PULL))
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
        node.socket = self.cluster_auth.secure_client(self._sync_context.socket(zmq.PUSH))
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
        priority: int = 0,
    ) -> asyncio.Queue:
        """Sends Generate to the best live node; updates arrive on the returned queue (pass
        one queue for several requests to read them merged). Raises LookupError when no node
        is alive, APIError 429 when the request would wait too long for its prefill, and
        RuntimeError when the node's socket cannot take the message."""
        node = self.live_node()
        if node is None:
            raise LookupError("no live node")
        if request_id in self.inflight:
            raise ValueError(f"request id {request_id!r} is in use")
        request = Generate(request_id, prompt_ids, sampling, priority=priority)
        entry = InFlight(queue if queue is not None else asyncio.Queue(), node, request=request)
        prefill, computing, num_tokens = self._route(entry, node)
        self._check_queue_delay(computing, num_tokens)
        self._send(entry, request_id, request_id, node, prefill, computing, num_tokens)
        entry.submitted_at = self.clock()
        self.inflight[request_id] = entry
        return entry.queue

    def _route(
        self, entry: InFlight, node: NodeState
    ) -> tuple[NodeState | None, NodeState, int]:
        """For a request going to `node`: its prefill node (a decode node is told one this
        request has not failed on, if one is alive; None for a colocated node), the node that
        computes its prompt, and how many prompt tokens that node likely has to compute."""
        prompt = entry.request.prompt_token_ids
        if node.role != "decode":
            return None, node, len(prompt)
        live = self.registry.live("prefill")
        fresh = [n for n in live if n.address not in entry.failed_prefills] or live
        prefill, cached = self.prefill_router.pick(fresh, prompt)
        return prefill, prefill, len(prompt) - cached

    def _check_queue_delay(self, node: NodeState, num_tokens: int) -> None:
        if self.max_queue_delay_s is None:
            return
        delay = self.prompt_queues.delay(node, num_tokens, self.clock())
        if delay is not None and delay.seconds > self.max_queue_delay_s:
            raise APIError(
                429,
                f"The server is overloaded: {delay.describe(node)}, more than the "
                f"{self.max_queue_delay_s:g} s a request may wait to start. Try again later.",
                code="rate_limit_exceeded",
            )

    def _send(
        self,
        entry: InFlight,
        request_id: str,
        wire_id: str,
        node: NodeState,
        prefill: NodeState | None,
        computing: NodeState,
        num_tokens: int,
    ) -> None:
        """Sends the entry's Generate to `node` as `wire_id`, naming `prefill` to a decode
        node; the request then waits in `computing`'s queue until it starts. Raises
        RuntimeError when the node's socket cannot take the message."""
        message = dataclasses.replace(
            entry.request,
            request_id=wire_id,
            prefill_address=prefill.address if prefill is not None else None,
        )
        try:
            node.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise RuntimeError("the node is not accepting requests") from None
        entry.node, entry.prefill, entry.queued_at = node, prefill, computing
        self.prompt_queues.add(computing, request_id, num_tokens, self.clock())
        node.promised_blocks += -(-len(message.prompt_token_ids) // (node.stats.block_size or 16))
        if prefill is not None:
            self.prefill_router.remember(prefill, message.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Forgets the request and tells its nodes to drop it (never blocks, never raises)."""
        entry = self._forget(request_id)
        if entry is not None:
            self._abort_on_nodes(entry, entry.wire_id or request_id)

    def _abort_on_nodes(self, entry: InFlight, wire_id: str) -> None:
        for node in (entry.node, entry.prefill):
            if node is None or node.socket is None:
                continue
            try:
                node.socket.send(encode(Abort(wire_id)), zmq.NOBLOCK)
            except zmq.ZMQError as error:
                logger.warning("could not send Abort for %s: %s", wire_id, error)

    def fail_all(self, message: str) -> None:
        """Ends every in-flight request now with a 503 (`message`), aborting it on its nodes."""
        for request_id, entry in list(self.inflight.items()):
            self.abort(request_id)
            entry.queue.put_nowait(RequestFailed(request_id, message, 503))

    def _forget(self, request_id: str) -> InFlight | None:
        entry = self.inflight.pop(request_id, None)
        if entry is None:
            return None
        if not entry.started:
            entry.started = True  # no token can reach the client any more
            if entry.queued_at is not None:
                self.prompt_queues.remove(entry.queued_at, request_id, self.clock())
        if entry.wire_id is not None:
            self._client_ids.pop(entry.wire_id, None)
        return entry

    def _lookup(self, wire_id: str) -> tuple[str, InFlight] | None:
        """The request a node message is about, unless it is about an attempt given up."""
        request_id = self._client_ids.get(wire_id, wire_id)
        entry = self.inflight.get(request_id)
        if entry is None or (entry.wire_id or request_id) != wire_id:
            return None
        return request_id, entry

    def _lost(self, request_id: str, entry: InFlight, reason: str) -> None:
        """The retry policy (module docstring): the request is sent again if it may be, else
        it fails with 503 and `reason`."""
        old_wire_id = entry.wire_id or request_id
        self._abort_on_nodes(entry, old_wire_id)
        if entry.prefill is not None:
            entry.failed_prefills.add(entry.prefill.address)
        if entry.queued_at is not None:
            self.prompt_queues.remove(entry.queued_at, request_id, self.clock())
        node = self.live_node()
        if not entry.started and entry.attempts <= self.max_retries and node is not None:
            wire_id = f"{request_id}~{entry.attempts}"
            try:
                self._send(entry, request_id, wire_id, node, *self._route(entry, node))
            except RuntimeError as error:
                reason = f"{reason}; the retry failed: {error}"
            else:
                entry.attempts += 1
                self._client_ids.pop(old_wire_id, None)
                self._client_ids[wire_id] = request_id
                entry.wire_id = wire_id
                if self.on_retry is not None:
                    self.on_retry()
                via = f" via prefill node {entry.prefill.node_id}" if entry.prefill else ""
                logger.warning(
                    "request %s: %s; retrying on node %s%s", request_id, reason, node.node_id, via
                )
                return
        logger.warning("request %s failed: %s", request_id, reason)
        self._forget(request_id)
        entry.queue.put_nowait(RequestFailed(request_id, reason, 503))

    def _started(self, request_id: str, entry: InFlight) -> None:
        if not entry.started:
            entry.started = True
            if entry.queued_at is not None:
                self.prompt_queues.started(entry.queued_at, request_id, self.clock())

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
        if isinstance(message, Heartbeat):
            self.registry.beat(message)
        elif isinstance(message, NodeStats):
            self.record_stats(message)
        elif isinstance(message, TokenBatch):
            for update in message.updates:
                self._deliver_in_order(update)
        elif isinstance(message, RequestFailed):
            found = self._lookup(message.request_id)
            if found is None:
                return
            request_id, entry = found
            if message.status == 503:
                self._lost(request_id, entry, message.message)
                return
            self._forget(request_id)
            self._abort_on_nodes(entry, message.request_id)  # the other node may hold it too
            message.request_id = request_id
            entry.queue.put_nowait(message)
        else:
            logger.warning("dropped an unexpected %s message", type(message).__name__)

    def _deliver_in_order(self, update: TokenUpdate) -> None:
        found = self._lookup(update.request_id)
        if found is None or update.offset < found[1].next_offset:
            return  # aborted, unknown, an attempt given up, or already delivered
        request_id, entry = found
        update.request_id = request_id
        entry.early[update.offset] = update
        while entry.next_offset in entry.early:
            ready = entry.early.pop(entry.next_offset)
            self._started(request_id, entry)
            entry.next_offset += len(ready.token_ids)
            entry.queue.put_nowait(ready)
            if ready.finish_reason is not None:
                self._forget(request_id)
                return

    async def _watchdog_loop(self) -> None:
        interval = min(WATCHDOG_INTERVAL_S, self.node_timeout_s / 4)
        last = self.clock()
        while True:
            await asyncio.sleep(interval)
            now = self.clock()
            late = now - last - interval
            last = now
            if late > self.node_timeout_s / 2:
                logger.warning("the router was stalled for %.1f s; liveness judged next round", late)
                continue
            self.fail_dead_nodes()

    def fail_dead_nodes(self) -> None:
        """Notes liveness changes; every in-flight request whose decode (or colocated) node is
        down, or whose prefill node is down before the first token came back, is lost."""
        for node in self.registry.sweep():
            if not node.up:
                self.prefill_router.forget(node)
                self.prompt_queues.forget(node)
            if self.on_liveness is not None:
                self.on_liveness(node)
        now = self.clock()
        for request_id, entry in list(self.inflight.items()):
            if not entry.node.alive(now, self.node_timeout_s):
                self._lost(request_id, entry, f"{_describe(entry.node)} stopped responding")
            elif (
                entry.prefill is not None
                and not entry.started
                and not entry.prefill.alive(now, self.node_timeout_s)
            ):
                self._lost(request_id, entry, f"{_describe(entry.prefill)} stopped responding")

    def _on_restart(self, node: NodeState) -> None:
        """A restarted node lost whatever its previous process held."""
        self.prefill_router.forget(node)
        self.prompt_queues.forget(node)
        for request_id, entry in list(self.inflight.items()):
            if entry.node is node or (entry.prefill is node and not entry.started):
                self._lost(request_id, entry, f"{_describe(node)} was restarted")


def _describe(node: NodeState) -> str:
    return f"the {node.role or 'unknown'} node {node.node_id or node.address}"
