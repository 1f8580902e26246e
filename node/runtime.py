"""The loop every node process runs (colocated, prefill, decode), over ZeroMQ.

Sockets (addresses come from the constructor; nothing is module-global):
  PULL, bound at `listen_address`     <- router and peer nodes (msgpack, `pdserve.wire.messages`)
  PUSH, connected to `router_address` -> router: TokenBatch, RequestFailed, NodeStats
  PUSH per peer address, on first use -> other nodes (PrefillRequest, PrefillDone)
  PUSH of the heartbeat thread        -> router: Heartbeat (node/heartbeat.py), every
                                         `heartbeat_interval`, during long engine steps too

Start: the engine warms up when the runtime is built (`LLMEngine.warm_up`), before anything is
sent: a first forward's one-time costs (kernel JIT compilation, library and allocator set-up)
may hold the GIL long enough to starve the heartbeat thread, so they are paid before the first
NodeStats registers the node with the router (node/heartbeat.py).

Loop (`run()` until `stop()`):
  1. poll the PULL socket for up to `poll_timeout_ms()` (0 while `busy()`, else IDLE_POLL_MS),
     so the work loop never blocks on I/O; then drain every pending message into `handle(message)`; malformed
     messages are logged in one line (no payload echo) and dropped.
  2. `work()`: one engine step and whatever the role does around it.
  3. NodeStats right after startup (the "ready" signal; its listen address also registers the
     node with a router that did not know it) and every `heartbeat_interval` seconds.
  4. Leak self-check, at most once per `heartbeat_interval` while the node is `idle()` (no
     request or transfer in flight): the count of blocks still in use, which nothing may hold
     when idle, and `engine.check_integrity()` (an error is logged and counts as a leak);
     NodeStats reports it as `kv.num_leaked_blocks` (the router exports it; it must stay 0).
NodeStats is built from typed parts (wire/node_stats.py), each from its producer: the identity
here, the engine's scheduling and KV cache (engine/stats_report.py), and the roles' hooks
`scheduling_stats()`, `token_totals()` and `kv_transfer_totals()`.
Sends never block: messages a PUSH socket cannot take now wait in one ordered outbox and are
retried every iteration; NodeStats are skipped while the outbox is not empty.
With a cluster secret (`cluster_auth`, wire/cluster_auth.py) the PULL socket is a CURVE
server and every PUSH a CURVE client: only holders of the secret reach the node, or are reached.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from typing import Any, ClassVar

import zmq

from pdserve.engine import stats_report
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.config import NodeConfig
from pdserve.node.heartbeat import HeartbeatThread
from pdserve.wire.messages import (
    Heartbeat,
    InvalidRequest,
    NodeStats,
    ProtocolError,
    RequestFailed,
    decode,
    encode,
)
from pdserve.wire.node_stats import KvTransferTotals, NodeIdentity, SchedulingStats, TokenTotals

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
MAX_OUTBOX = 100_000


def refuse_tensor_parallel_on_gpu(engine_config: EngineConfig, role: str) -> None:
    """ValueError for tensor parallelism on CUDA on a node that moves KV to or from another
    node: a transfer moves a node cache holding every rank's shard (engine/kv/shared_kv_cache.py),
    which exists on the CPU; GPU ranks' shards would each need a handle of their own."""
    if engine_config.tensor_parallel_size > 1 and engine_config.resolve_device().type != "cpu":
        raise ValueError(
            f"tensor_parallel_size {engine_config.tensor_parallel_size} on "
            f"{engine_config.resolve_device()} is not supported for {role} nodes yet: "
            "disaggregated tensor parallelism runs on the CPU; use a colocated node "
            "(`pdserve serve --colocated`) for tensor parallelism on GPUs"
        )


def with_chosen_port(address: str, bound: str) -> str:
    """`address` (the advertised or listen address) with the port the OS chose where it asks
    for port 0 (`--listen tcp://HOST:0`): the router learns it from the node's stats."""
    host, _, port = address.rpartition(":")
    return f"{host}:{bound.rpartition(':')[2]}" if port == "0" else address


class NodeRuntime:
    """The loop and sockets of one node; the roles (node/colocated.py, prefill_node/,
    decode_node/) subclass it and fill in the hooks below."""

    role: ClassVar[str] = ""

    def __init__(self, *, engine: LLMEngine, config: NodeConfig) -> None:
        self.engine = engine
        self.config = config
        self.cluster_auth = config.cluster_auth
        self.node_id = config.node_id
        self.instance_id = uuid.uuid4().hex[:16]
        self.advertise_address = config.reachable_address
        self.num_leaked_blocks = 0
        self.fingerprint = ""  # the model's KV layout, set by the roles that move KV
        self._stop = threading.Event()
        self._outbox: collections.deque[tuple[Any, bytes]] = collections.deque()
        self._peers: dict[str, Any] = {}
        engine.warm_up()  # before the first heartbeat: a node is ready once it is warm

    # -- hooks for the roles -----------------------------------------------------------------

    def handle(self, message: Any) -> None:
        logger.warning("dropped an unexpected %s message", message.type)

    def work(self) -> None:
        """Called every iteration."""

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def idle(self) -> bool:
        """No request or transfer in flight: every block must be free or kept by the cache."""
        return not self.busy()

    def poll_timeout_ms(self) -> int:
        """How long the loop may wait for a message: 0 while there is work to do."""
        return 0 if self.busy() else IDLE_POLL_MS

    def scheduling_stats(self) -> SchedulingStats:
        """NodeStats' `scheduling`: the engine's; a role that holds requests before the engine
        counts them as waiting too."""
        return stats_report.scheduling_stats(self.engine)

    def token_totals(self) -> TokenTotals:
        """NodeStats' `tokens`: a role that generates counts its requests' tokens."""
        return TokenTotals()

    def kv_transfer_totals(self) -> KvTransferTotals:
        """NodeStats' `kv_transfer`: a role that moves KV counts its transfers."""
        return KvTransferTotals()

    def shutdown(self) -> None:
        """Called once when the loop ends, before the sockets close: stops the engine's worker
        ranks (tensor parallelism); a role that overrides it calls this last."""
        self.engine.close()

    # -- loop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Asks `run()` to return after the current iteration (safe from signal handlers)."""
        self._stop.set()

    def run(self) -> None:
        self._context = zmq.Context()
        self._pull = self.cluster_auth.secure_server(self._context.socket(zmq.PULL))
        self._push = self.cluster_auth.secure_client(self._context.socket(zmq.PUSH))
        config = self.config
        heartbeat = HeartbeatThread(
            self._context,
            config.router_address,
            config.heartbeat_interval,
            Heartbeat(self.node_id, self.instance_id),
            config.stall_limit_s,
            self.cluster_auth,
        )
        try:
            self._pull.bind(config.listen_address)
            bound = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
            self.advertise_address = with_chosen_port(config.reachable_address, bound)
            self._push.connect(config.router_address)
            poller = zmq.Poller()
            poller.register(self._pull, zmq.POLLIN)
            logger.info(
                "%s node %s listening on %s, sending to %s",
                self.role,
                self.node_id,
                bound,
                config.router_address,
            )
            self.send_stats()
            heartbeat.start()
            next_stats = next_leak_check = time.monotonic() + config.heartbeat_interval
            while not self._stop.is_set():
                if poller.poll(self.poll_timeout_ms()):
                    self._drain()
                self.work()
                self._flush()
                heartbeat.progress()
                now = time.monotonic()
                if now >= next_leak_check and self.idle():
                    self.num_leaked_blocks = self.check_leaks()
                    next_leak_check = now + config.heartbeat_interval
                if now >= next_stats:
                    self.send_stats()
                    next_stats = now + config.heartbeat_interval
        finally:
            heartbeat.stop()
            self.shutdown()
            for socket in (self._pull, self._push, *self._peers.values()):
                socket.close(linger=0)
            self._context.term()
            logger.info("node %s stopped", self.node_id)

    def _drain(self) -> None:
        while True:
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode(data)
            except InvalidRequest as error:
                logger.info("rejected request %s: %s", error.request_id, error)
                self.send(RequestFailed(error.request_id, str(error), 400))
                continue
            except ProtocolError as error:
                logger.warning("dropped a malformed message (%d bytes): %s", len(data), error)
                continue
            self.handle(message)

    def check_leaks(self) -> int:
        """Called while `idle()`: the number of blocks in use although no request or transfer
        holds them (at least 1 when the block accounting itself is inconsistent)."""
        manager = self.engine.block_manager
        leaked = manager.num_blocks - manager.num_free_blocks
        try:
            self.engine.check_integrity()
        except RuntimeError as error:
            logger.error("node %s: KV block accounting is inconsistent: %s", self.node_id, error)
            leaked = max(leaked, 1)
        if leaked != self.num_leaked_blocks and leaked:
            logger.error(
                "node %s: %d KV blocks are in use while no request holds them (leaked)",
                self.node_id,
                leaked,
            )
        return leaked

    # -- outbound ----------------------------------------------------------------------------

    def identity(self) -> NodeIdentity:
        engine = self.engine
        return NodeIdentity(
            node_id=self.node_id,
            role=self.role,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            instance_id=self.instance_id,
            listen_address=self.advertise_address,
            model_fingerprint=self.fingerprint,
            dtype=str(engine.runner.dtype).removeprefix("torch."),
            block_size=engine.config.block_size,
            tensor_parallel_size=engine.config.tensor_parallel_size,
        )

    def stats(self) -> NodeStats:
        return NodeStats(
            identity=self.identity(),
            scheduling=self.scheduling_stats(),
            kv=stats_report.kv_cache_stats(self.engine, self.num_leaked_blocks),
            tokens=self.token_totals(),
            kv_transfer=self.kv_transfer_totals(),
        )

    def send_stats(self) -> None:
        """Droppable: skipped while results wait, dropped if the pipe is full."""
        if self._outbox:
            return
        try:
            self._push.send(encode(self.stats()), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def send(self, message: Any, address: str | None = None) -> None:
        """Sends to the router (or to the node at `address`); never dropped, kept in order."""
        socket = self._push if address is None else self._peer(address)
        if len(self._outbox) >= MAX_OUTBOX:
            self._outbox.popleft()
            logger.error("outbox full (a peer unreachable?): dropped the oldest message")
        self._outbox.append((socket, encode(message)))
        self._flush()

    def _peer(self, address: str) -> Any:
        socket = self._peers.get(address)
        if socket is None:
            socket = self.cluster_auth.secure_client(self._context.socket(zmq.PUSH))
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self._peers[address] = socket
        return socket

    def _flush(self) -> None:
        while self._outbox:
            socket, data = self._outbox[0]
            try:
                socket.send(data, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()
