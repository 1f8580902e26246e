"""The router's client for the nodes: sends Generate and Abort, receives tokens and stats, and
moves each request through its lifecycle. It glues the node registry (which nodes exist and
are alive, router/cluster/node_registry.py), the links (sockets, router/cluster/node_links.py), the routing
choices (router/cluster/routing.py, router/cluster/queue_delay.py) and the in-flight table
(router/cluster/inflight.py).

With live decode nodes a request goes to a decode node, and its prompt is computed where
`--disagg-policy` places it (router/cluster/prefill_placement.py): by a prefill node the
Generate names (aborts then go to both), or by the decode node itself. Otherwise a colocated
node serves it.

Lifecycle of a request (each state with what ends it and its deadline):
- submitted: `submit()` picks the serving node and, for a decode node, a prefill node. No live
  node: LookupError. Early refusal: a prompt that would wait longer than `max_queue_delay_s` at
  the node that computes it (router/cluster/queue_delay.py) is refused with 429 before anything
  is sent (`QueueDelayBound`, router/cluster/admission.py). Otherwise Generate is sent and the request is waiting.
- waiting (sent, no token back yet; in the prompt queue of the node computing it): its first
  token makes it started; it is lost when a node it needs stops responding (no heartbeat for
  `node_timeout_s`, seen by the watchdog within `WATCHDOG_INTERVAL_S`), is restarted, or
  answers RequestFailed 503 (a KV transfer failed or timed out, no KV blocks in time: the
  nodes own those deadlines).
- started (tokens flow to the client in output order): its finishing token ends it. It is lost
  when its decode (or colocated) node stops responding (`node_timeout_s`), is restarted or
  answers 503; a client that reads nothing for `stream_stall_timeout_s` is aborted
  (router/api/sse.py, router/generation.py).
  In either state an abort, or a RequestFailed other than 503, ends it.
- lost: the retry policy. While none of its output has reached the client (tokens whose text
  the router still holds back do not count), a lost request is aborted on its nodes and sent
  again under a new wire id (`<id>~<attempt>`, so nothing of the old attempt can be mistaken
  for the new) to live nodes, preferring a prefill node it has not failed on, at most
  `max_retries` times: it is waiting again. Otherwise (output has reached the client, no
  retry is left, no node is live, or the resend fails) it fails with 503, which
  the client sees as an error (an error event ending its stream).
- done: forgotten, and aborted on its nodes unless its last token came back.

Two tasks run while the client is started: the receiver, which dispatches every TokenUpdate
(in output order) and RequestFailed to the queue of its request and records each node's
NodeStats (its heartbeat, see node_registry.py), and the watchdog, which every
`WATCHDOG_INTERVAL_S` notes the nodes that went down or came back and hands every request
that lost a node to the retry policy. A watchdog round that itself ran late (the router's
event loop was stalled, so heartbeats may be sitting unread) judges nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.router.cluster.admission import QueueDelayBound
from pdserve.router.cluster.inflight import InFlight, InFlightTable
from pdserve.router.cluster.node_links import NodeLinks
from pdserve.router.cluster.node_registry import NodeRegistry, NodeState
from pdserve.router.cluster.prefill_placement import PlacementSettings, PrefillPlacement
from pdserve.router.cluster.queue_delay import PromptQueues
from pdserve.router.cluster.routing import PrefillRouter, pick_decode_node
from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.messages import (
    Choice,
    Generate,
    Heartbeat,
    NodeStats,
    PromptProgress,
    ProtocolError,
    RequestFailed,
    TokenBatch,
    decode,
)
from pdserve.wire.roles import Role
from pdserve.wire.sampling_params import SamplingParams

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
        placement: PlacementSettings | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.links = NodeLinks(listen_address, cluster_auth or ClusterAuth.none())
        self.registry = NodeRegistry(
            node_addresses, node_timeout_s, self.links.connect, clock,
            on_restart=self._on_restart, disconnect=self.links.disconnect,
        )
        self.node_timeout_s = node_timeout_s
        self.on_stats = on_stats
        self.on_liveness = on_liveness
        self.on_retry = on_retry
        self.clock = clock
        self.prompt_queues = PromptQueues()
        self.num_arriving = 0  # requests between their admission checks and their submit
        self.prefill_router = prefill_router or PrefillRouter(self.prompt_queues)
        self.placement = PrefillPlacement(
            placement or PlacementSettings(), self.prefill_router, self.prompt_queues, clock,
            registry,
        )
        self.queue_delay_bound = QueueDelayBound(max_queue_delay_s, self.prompt_queues, clock)
        self.max_retries = max_retries
        self.inflight = InFlightTable(self.prompt_queues, clock)
        self._tasks: list[asyncio.Task] = []

    @property
    def nodes(self) -> list[NodeState]:
        return self.registry.nodes

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.links.open(self.nodes)
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
        for request_id in list(self.inflight.entries):
            self.abort(request_id)
        self.links.close(self.nodes)

    # -- state -------------------------------------------------------------------------------

    def live_node(self) -> NodeState | None:
        """A node that can serve a request now: a decode node when a prefill node is alive
        too, or when the policy lets decode nodes compute prompts themselves; else a
        colocated node; None when neither is."""
        if self.registry.live(Role.PREFILL) or not self.placement.needs_prefill_nodes:
            decode_node = pick_decode_node(self.registry.live(Role.DECODE))
            if decode_node is not None:
                return decode_node
        return pick_decode_node(self.registry.live(Role.COLOCATED))

    def any_alive(self) -> bool:
        return self.live_node() is not None

    @property
    def num_waiting(self) -> int:
        """Requests submitted that have not produced a token yet."""
        return self.inflight.num_waiting

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
        sampling: SamplingParams,
        queue: asyncio.Queue | None = None,
        priority: int = 0,
    ) -> asyncio.Queue:
        """Sends Generate to the best live node; updates arrive on the returned queue (pass
        one queue for several requests to read them merged). Raises LookupError when no node
        is alive, APIError 429 when the request would wait too long for its prefill, and
        RuntimeError when the node's socket cannot take the message."""
        return self.submit_choices(request_id, prompt_ids, [(request_id, sampling)], queue, priority)

    def submit_choices(
        self,
        prompt_id: str,
        prompt_ids: list[int],
        choices: list[tuple[str, SamplingParams]],
        queue: asyncio.Queue | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> asyncio.Queue:
        """`submit` for n choices (id, sampling) of one prompt: ONE Generate, under
        `prompt_id`, carrying them (router/choice_groups.py); each choice is then a request
        of its own here (its updates, abort and retry, by its id). One choice travels as a
        plain Generate under its own id. `group`: the client request it belongs to (the
        engine's fair share, engine/sched/request_share.py)."""
        node = self.live_node()
        if node is None:
            raise LookupError("no live node")
        in_use = next((c for c, _ in choices if c in self.inflight), None)
        if in_use is not None:
            raise ValueError(f"request id {in_use!r} is in use")
        queue = queue if queue is not None else asyncio.Queue()
        entries = {
            choice_id: InFlight(
                queue,
                node,
                request=Generate(choice_id, prompt_ids, sampling, priority=priority, group=group),
            )
            for choice_id, sampling in choices
        }
        first_id, first = next(iter(entries.items()))
        prefill, computing, num_tokens = self._route(first, node)
        self.queue_delay_bound.check_node(computing, num_tokens)
        if len(entries) == 1:
            self._send(first, first_id, first_id, node, prefill, computing, num_tokens)
        else:
            message = Generate(
                prompt_id,
                prompt_ids,
                choices[0][1],
                prefill_address=prefill.address if prefill is not None else None,
                priority=priority,
                choices=[Choice(choice_id, sampling) for choice_id, sampling in choices],
                group=group,
            )
            self._send_message(node, message, prefill)
            for index, (choice_id, entry) in enumerate(entries.items()):  # the prompt, once
                tokens = num_tokens if index == 0 else 0
                self.inflight.sent(choice_id, entry, node, prefill, computing, tokens, prompt_id)
        for choice_id, entry in entries.items():
            self.inflight.add(choice_id, entry)
        return queue

    def _route(
        self, entry: InFlight, node: NodeState
    ) -> tuple[NodeState | None, NodeState, int]:
        """For a request going to `node`: its prefill node (for a decode node, where the
        policy places its prompt, preferring prefill nodes this request has not failed on;
        None for a colocated node or a prompt the decode node computes), the node that
        computes its prompt, and how many prompt tokens that node likely has to compute."""
        prompt = entry.request.prompt_token_ids
        if node.role != Role.DECODE:
            return None, node, len(prompt)
        live = self.registry.live(Role.PREFILL)
        fresh = [n for n in live if n.address not in entry.failed_prefills] or live
        choice = self.placement.place(node, fresh, prompt)
        return choice.prefill, choice.prefill or node, choice.num_tokens

    def check_overload(self) -> None:
        """429 before a request is read or tokenized, when every node that could compute its
        prompt predicts a queue delay past the bound for the requests ahead of it: those
        queued there, and those still being read and tokenized (`arriving`), each counted as
        the mean prompt of recent submits, spread over the nodes. Under a burst a refusal then
        costs the same however many requests wait to be tokenized."""
        bounded = self.queue_delay_bound.max_queue_delay_s is not None
        node = self.live_node() if bounded else None
        if node is None:
            return  # no bound, or no node: the route answers 503 later
        candidates = [node]
        if node.role == Role.DECODE:
            candidates = self.placement.candidates(node, self.registry.live(Role.PREFILL))
        self.queue_delay_bound.check_nodes(candidates, self.num_arriving)

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """A request from its admission checks to its submit (its body read and tokenized):
        `check_overload` counts it meanwhile."""
        self.num_arriving += 1
        try:
            yield
        finally:
            self.num_arriving -= 1

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
        self._send_message(node, message, prefill)
        self.inflight.sent(request_id, entry, node, prefill, computing, num_tokens)

    def _send_message(self, node: NodeState, message: Generate, prefill: NodeState | None) -> None:
        self.links.send(node, message)
        block_size = node.stats.identity.block_size or 16
        node.promised_blocks += -(-len(message.prompt_token_ids) // block_size)
        if prefill is not None or node.role == Role.DECODE:  # where its blocks are now cached
            self.prefill_router.remember(prefill or node, message.prompt_token_ids)

    def shown(self, request_id: str) -> None:
        """Some output of the request reached its client: a loss fails it from now on."""
        self.inflight.shown(request_id)

    def abort(self, request_id: str) -> None:
        """Forgets the request and tells its nodes to drop it (never blocks, never raises)."""
        entry = self.inflight.forget(request_id)
        if entry is not None:
            self.links.send_abort(entry.wire_id or request_id, entry.node, entry.prefill)

    def fail_all(self, message: str) -> None:
        """Ends every in-flight request now with a 503 (`message`), aborting it on its nodes."""
        for request_id, entry in self.inflight.items():
            self.abort(request_id)
            entry.queue.put_nowait(RequestFailed(request_id, message, 503))

    def _lost(self, request_id: str, entry: InFlight, reason: str) -> None:
        """The retry policy (module docstring): the request is sent again if it may be, else
        it fails with 503 and `reason`."""
        self.links.send_abort(entry.wire_id or request_id, entry.node, entry.prefill)
        self.inflight.give_up_attempt(request_id, entry)
        node = self.live_node()
        if not entry.shown and entry.attempts <= self.max_retries and node is not None:
            wire_id = f"{request_id}~{entry.attempts}"
            try:
                self._send(entry, request_id, wire_id, node, *self._route(entry, node))
            except RuntimeError as error:
                reason = f"{reason}; the retry failed: {error}"
            else:
                self.inflight.retried(request_id, entry, wire_id)
                if self.on_retry is not None:
                    self.on_retry()
                via = f" via prefill node {entry.prefill.node_id}" if entry.prefill else ""
                logger.warning(
                    "request %s: %s; retrying on node %s%s", request_id, reason, node.node_id, via
                )
                return
        logger.warning("request %s failed: %s", request_id, reason)
        self.inflight.forget(request_id)
        entry.queue.put_nowait(RequestFailed(request_id, reason, 503))

    # -- tasks -------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            data = await self.links.receive()
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
                self.inflight.deliver(update)
        elif isinstance(message, PromptProgress):
            for wire_id, num_computed in message.computed.items():
                if isinstance(num_computed, int) and not isinstance(num_computed, bool):
                    self.inflight.progress(wire_id, num_computed)
        elif isinstance(message, RequestFailed):
            found = self.inflight.lookup(message.request_id)
            if found is None:
                return
            request_id, entry = found
            if message.status == 503:
                self._lost(request_id, entry, message.message)
                return
            self.inflight.forget(request_id)
            # the other node may hold it too
            self.links.send_abort(message.request_id, entry.node, entry.prefill)
            message.request_id = request_id
            entry.queue.put_nowait(message)
        else:
            logger.warning("dropped an unexpected %s message", type(message).__name__)

    async def _watchdog_loop(self) -> None:
        interval = min(WATCHDOG_INTERVAL_S, self.node_timeout_s / 4)
        last = self.clock()
        while True:
            await asyncio.sleep(interval)
            now = self.clock()
            late = now - last - interval
            last = now
            for node, connected in self.links.connection_changes():
                self.registry.connection_changed(node, connected)
            if late > self.node_timeout_s / 2:
                logger.warning(
                    "the router was stalled for %.1f s; liveness judged next round", late
                )
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
        def dead(node: NodeState) -> bool:
            return not node.up

        for request_id, entry, node in self.inflight.lost_with(dead):
            self._lost(request_id, entry, f"{_describe(node)} stopped responding")

    def _on_restart(self, restarted: NodeState) -> None:
        """A restarted node lost whatever its previous process held."""
        self.prefill_router.forget(restarted)
        self.prompt_queues.forget(restarted)
        for request_id, entry, _ in self.inflight.lost_with(lambda node: node is restarted):
            self._lost(request_id, entry, f"{_describe(restarted)} was restarted")


def _describe(node: NodeState) -> str:
    return f"the {node.role or 'unknown'} node {node.node_id or node.address}"
