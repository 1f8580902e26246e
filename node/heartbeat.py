"""A node's heartbeat: a small `Heartbeat` message to the router from a thread of its own.

NodeStats leave the node loop between engine steps, so a long step (a big prefill chunk) would
silence them; the heartbeat thread keeps telling the router the node process is alive every
`interval` seconds over its own PUSH socket (zmq sockets are never shared across threads; the
context is), so the router can tell a node that is silent (no heartbeat for its node timeout,
30 s by default) from one that is merely in a long step. A node whose process exits is down at
once in the router's eyes anyway: its connection closes (router/cluster/node_registry.py). The thread also watches that socket's handshakes: a router
that refuses them (its cluster secret differs from the node's, or only one side has one) never
hears the node, and the node logs that once, as an error naming `--cluster-secret`.

What keeps a busy node alive in the router's eyes, and why no leniency is needed:
  - this thread runs during any step that lets it: torch releases the GIL inside its kernels,
    and Python hands the GIL over every 5 ms otherwise; on a machine where every core is busy
    the gaps between heartbeats stay far under the node timeout the router allows;
  - the one step that may hold the GIL (or the device) for seconds, a node's first forward
    (kernel JIT compilation, library and allocator set-up), runs before the node announces
    itself (`LLMEngine.warm_up`, when the NodeRuntime is built), so a node is registered only
    once it is ready and that cost never counts against it;
  - the router holds no heartbeat it has not read yet against a node: its own stalls do not
    make live nodes look dead (router/cluster/node_registry.py).
A short node timeout (two missed heartbeats) was the rule once: on a host whose cores other
work kept busy it declared healthy nodes dead and cut streams after their first tokens. Death is
now noticed by the closed connection, so the silence bound can be long.

The node loop marks each iteration (`progress`). A loop that makes no progress for
`stall_limit_s` (a wedged step) stops the heartbeat: the router then treats the node as dead
and retries or fails its requests instead of letting their clients wait forever. Heartbeats are
droppable: one the socket cannot take now is skipped.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.wire.cluster_auth import ClusterAuth
from pdserve.wire.messages import Heartbeat, encode

logger = logging.getLogger(__name__)

HEARTBEAT_SNDHWM = 8
DEFAULT_STALL_LIMIT_S = 120.0
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)


class HeartbeatThread:
    def __init__(
        self,
        context: zmq.Context,
        router_address: str,
        interval: float,
        message: Heartbeat,
        stall_limit_s: float = DEFAULT_STALL_LIMIT_S,
        cluster_auth: ClusterAuth | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval is {interval} s; expected a positive number")
        self.context = context
        self.router_address = router_address
        self.interval = interval
        self.message = message
        self.stall_limit_s = stall_limit_s
        self.cluster_auth = cluster_auth or ClusterAuth.none()
        self._progress_at = time.monotonic()
        self._handshake_failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self) -> None:
        """The node loop finished an iteration (one float assignment: thread-safe)."""
        self._progress_at = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{self.message.node_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread and closes its socket (before the context is terminated)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        data = encode(self.message)
        socket = self.cluster_auth.secure_client(self.context.socket(zmq.PUSH))
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, HEARTBEAT_SNDHWM)
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED
        for event in HANDSHAKE_FAILURES:
            events |= event
        monitor = socket.get_monitor_socket(events)
        socket.connect(self.router_address)
        stalled = False
        try:
            while not self._stop.wait(self.interval):
                self._note_handshakes(monitor)
                stalled_now = time.monotonic() - self._progress_at > self.stall_limit_s
                if stalled_now != stalled:
                    stalled = stalled_now
                    if stalled:
                        logger.error(
                            "node %s made no progress for %.0f s: heartbeats stop until it does",
                            self.message.node_id,
                            self.stall_limit_s,
                        )
                    else:
                        logger.warning("node %s makes progress again", self.message.node_id)
                if stalled:
                    continue
                try:
                    socket.send(data, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    def _note_handshakes(self, monitor: zmq.Socket) -> None:
        """Logs when the router starts refusing this node's handshakes, and when it stops."""
        while monitor.poll(0):
            failing = recv_monitor_message(monitor)["event"] in HANDSHAKE_FAILURES
            if failing == self._handshake_failing:
                continue
            self._handshake_failing = failing
            if failing:
                logger.error(
                    "node %s: the router at %s refuses the connection handshake, so it does "
                    "not hear this node: the router and every node need the same "
                    "--cluster-secret, or none of them any",
                    self.message.node_id,
                    self.router_address,
                )
            else:
                logger.warning(
                    "node %s: the router accepts its handshake again", self.message.node_id
                )
