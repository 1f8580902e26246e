"""The decode side of the KV channel: a ROUTER socket served by one I/O thread, a ledger of
expected transfers (kvtransfer/ledger.py), and a transport that says where the buffer lives.

The I/O thread owns the socket. For each frame sequence it decodes the msgpack header (nothing
else is ever decoded), checks it against the ledger and the descriptor (lengths, block ids,
layer range, dtype) before any byte is written, and logs and drops anything that fails. It also
fires deadlines and release times. The owner's calls (expect, abort) take the ledger lock, which
the I/O thread holds while it checks and applies a write, so an abort never races a scatter.
With `PDSERVE_KV_FAULTS` set at construction, Committed notices pass through a fault injector
(kvtransfer/faults.py) that drops, duplicates or holds them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.kv.shared_segment import NODE_ID_PATTERN
from pdserve.kvtransfer.base import KVReceiver, TransferEvent, TransferKind
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.events import EventBoard
from pdserve.kvtransfer.faults import FaultInjector
from pdserve.kvtransfer.ledger import TransferLedger
from pdserve.kvtransfer.messages import (
    Abandon,
    Ack,
    Begin,
    Committed,
    Data,
    Grant,
    KVProtocolError,
    Refuse,
    Reject,
    Written,
    decode_header,
    encode_header,
)
from pdserve.kvtransfer.transports.base import ReceiverTransport
from pdserve.kvtransfer.transports.registry import receiver_transport
from pdserve.kvtransfer.wakeup import Wakeup
from pdserve.wire.cluster_auth import ClusterAuth

logger = logging.getLogger(__name__)

MAX_IDLE_POLL_S = 0.5
START_TIMEOUT_S = 10.0
MAX_MESSAGES_PER_ROUND = 64


@dataclass(frozen=True)
class ReceiverConfig:
    """With a cluster secret (`cluster_auth`) the ROUTER socket is a CURVE server: only
    holders of the secret can connect."""

    node_id: str
    bind_address: str = "tcp://127.0.0.1:0"
    advertise_host: str | None = None
    release_grace_s: float = 1.0
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth.none)

    def __post_init__(self) -> None:
        if not NODE_ID_PATTERN.fullmatch(self.node_id):
            raise ValueError(f"node id {self.node_id!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if not self.bind_address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"bind address {self.bind_address!r} must be tcp://... or ipc://...")
        if not 0 <= self.release_grace_s <= 600:
            raise ValueError(f"release_grace_s is {self.release_grace_s}; expected 0-600 s")


class ChannelReceiver(KVReceiver):
    def __init__(self, transport: str | ReceiverTransport, config: ReceiverConfig) -> None:
        if isinstance(transport, str):
            transport = receiver_transport(transport, config.node_id)
        self.transport = transport
        self.config = config
        self._board = EventBoard({TransferKind.COMPLETE, TransferKind.RELEASED})
        self._lock = threading.Lock()
        self._outbox: list[tuple[bytes, Any]] = []
        self._wakeup = Wakeup()
        self._closing = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ledger: TransferLedger | None = None
        self._kv_cache: KVCache | None = None
        self._descriptor: KVDescriptor | None = None
        self._faults = FaultInjector.from_environ(f"KV receiver {config.node_id}")

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache:
        return self.transport.allocate_kv_cache(spec, num_blocks, device)

    def register(self, kv_cache: KVCache, model_fingerprint: str) -> KVDescriptor:
        if self._thread is not None:
            raise RuntimeError("a KV receiver registers one buffer, once")
        self._kv_cache = kv_cache
        self._ledger = TransferLedger(
            kv_cache.num_blocks, kv_cache.spec.num_layers, self.transport.strategy,
            self.config.release_grace_s,
        )
        endpoint: list[str] = []
        self._thread = threading.Thread(
            target=self._serve, args=(endpoint,), name=f"kv-receiver-{self.config.node_id}",
            daemon=True,
        )
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S) or self._start_error is not None:
            raise RuntimeError(f"KV receiver could not bind {self.config.bind_address}") from (
                self._start_error
            )
        try:
            handle = self.transport.export(kv_cache, endpoint[0])
        except BaseException:
            self.close()
            raise
        self._descriptor = KVDescriptor.for_cache(
            self.transport.name, self.config.node_id, endpoint[0], kv_cache.spec,
            kv_cache.num_blocks, model_fingerprint, handle, kv_cache.num_ranks,
        )
        return self._descriptor

    @property
    def descriptor(self) -> KVDescriptor:
        if self._descriptor is None:
            raise RuntimeError("the KV receiver has not registered a buffer yet")
        return self._descriptor

    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        deadline: float,
        budget_s: float | None = None,
    ) -> None:
        with self._lock:
            self._ledger.expect(
                transfer_id, list(block_ids), deadline, time.monotonic(), budget_s
            )
        self._wakeup.wake()

    def abort(self, transfer_id: str) -> None:
        with self._lock:
            self._ledger.fail(
                transfer_id, f"KV transfer for request {transfer_id!r} was aborted by the decode node"
            )
            self._collect_actions()
        self._wakeup.wake()

    def poll(self) -> list[TransferEvent]:
        return self._board.take_all()

    def wait(self, transfer_id: str, timeout: float) -> TransferEvent:
        return self._board.wait(transfer_id, timeout)

    def held_block_count(self) -> int:
        with self._lock:
            return self._ledger.held_block_count() if self._ledger is not None else 0

    def close(self) -> None:
        """Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wakeup.wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._wakeup.close()
        self.transport.close()
        self._kv_cache = None
        if self._faults is not None:
            self._faults.close()

    def _collect_actions(self) -> None:
        """Moves the ledger's events to the board and its notices to the outbox (lock held)."""
        events, notices = self._ledger.take_actions()
        self._board.post(events)
        self._outbox.extend(notices)

    def _serve(self, endpoint: list[str]) -> None:
        context = zmq.Context()
        socket = self.config.cluster_auth.secure_server(context.socket(zmq.ROUTER))
        try:
            socket.setsockopt(zmq.LINGER, 0)
            max_frame = self._kv_cache.num_blocks * self._kv_cache.spec.bytes_per_block
            socket.setsockopt(zmq.MAXMSGSIZE, max_frame + (1 << 20))
            socket.bind(self.config.bind_address)
            endpoint.append(self._advertised(socket.getsockopt_string(zmq.LAST_ENDPOINT)))
        except zmq.ZMQError as error:
            self._start_error = error
            socket.close()
            context.term()
            self._started.set()
            return
        self._started.set()
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wakeup.read_fd, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                ready = dict(poller.poll(self._poll_timeout_ms()))
                if self._wakeup.read_fd in ready:
                    self._wakeup.drain()
                for _ in range(MAX_MESSAGES_PER_ROUND):
                    if not socket.poll(0, zmq.POLLIN):
                        break
                    frames = socket.recv_multipart(copy=False)
                    try:
                        self._handle(socket, frames)
                    except Exception:  # a bad message must not stop the node
                        logger.exception("KV channel: dropped a message that failed to apply")
                with self._lock:
                    self._ledger.expire(time.monotonic())
                    self._collect_actions()
                    outbox, self._outbox = self._outbox, []
                for identity, message in outbox:
                    self._send_notice(socket, identity, message)
                if self._faults is not None:
                    self._faults.flush(time.monotonic())
        finally:
            socket.close(linger=0)
            context.term()

    def _send_notice(self, socket: zmq.Socket, identity: bytes, message: Any) -> None:
        parts = [identity, encode_header(message)]
        if self._faults is not None and isinstance(message, Committed):
            self._faults.send("done", socket.send_multipart, parts, time.monotonic())
        else:
            socket.send_multipart(parts)

    def _advertised(self, bound: str) -> str:
        """The bound endpoint with the host prefill nodes should dial (for 0.0.0.0 binds)."""
        if self.config.advertise_host is None or not bound.startswith("tcp://"):
            return bound
        port = bound.rsplit(":", 1)[1]
        return f"tcp://{self.config.advertise_host}:{port}"

    def _poll_timeout_ms(self) -> int:
        with self._lock:
            next_timer = self._ledger.next_timer()
        if self._faults is not None and self._faults.next_due() is not None:
            next_timer = min(next_timer or float("inf"), self._faults.next_due())
        if next_timer is None:
            return int(MAX_IDLE_POLL_S * 1000)
        return max(0, min(int((next_timer - time.monotonic()) * 1000) + 1, 1000))

    def _handle(self, socket: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            logger.warning("KV channel: dropped a message without a header")
            return
        try:
            message = decode_header(frames[1].buffer)
        except KVProtocolError as error:
            logger.warning("KV channel: dropped a malformed header: %s", error)
            return
        data_frames = frames[2:]
        if isinstance(message, Data):
            reply = self._apply_data(identity, message, data_frames)
        elif data_frames:
            logger.warning(
                "KV channel: dropped %s for %r carrying %d unexpected data frames",
                type(message).__name__, message.transfer_id, len(data_frames),
            )
            return
        elif isinstance(message, Begin):
            reply = self._grant(identity, message)
        elif isinstance(message, Written):
            reply = self._record_written(identity, message)
        elif isinstance(message, Abandon):
            with self._lock:
                self._ledger.abandoned(message.transfer_id, identity, message.reason)
                self._collect_actions()
            return
        else:
            logger.warning(
                "KV channel: dropped a %s message, which only a decode node sends",
                type(message).__name__,
            )
            return
        if reply is not None:
            socket.send_multipart([identity, encode_header(reply)])

    def _grant(self, identity: bytes, message: Begin) -> Any:
        with self._lock:
            granted = self._ledger.grant(message.transfer_id, identity, time.monotonic())
        if isinstance(granted, str):
            logger.warning("KV channel: refused transfer %r: %s", message.transfer_id, granted)
            return Refuse(message.transfer_id, granted)
        seconds_left = max(granted.deadline - time.monotonic(), 0.0)
        return Grant(message.transfer_id, list(granted.block_ids), seconds_left)

    def _record_written(self, identity: bytes, message: Written) -> Any:
        if not isinstance(message, self.transport.strategy.write_message):
            return self._drop_other_write_kind(message)
        with self._lock:
            reason = self._ledger.check_write(
                message.transfer_id, identity, message.block_ids, message.layer_start,
                message.layer_end,
            )
            if reason is None:
                seconds_left = self._ledger.record_write(
                    message.transfer_id, message.block_ids, message.layer_start,
                    message.layer_end, time.monotonic(), message.pace_s,
                )
                self._collect_actions()
                return Ack(message.transfer_id, message.seq, seconds_left)
        return self._refuse(message, reason)

    def _apply_data(self, identity: bytes, message: Data, data_frames: list[zmq.Frame]) -> Any:
        if not isinstance(message, self.transport.strategy.write_message):
            return self._drop_other_write_kind(message)
        spec = self._kv_cache.spec
        if not 0 <= message.layer_start < message.layer_end <= spec.num_layers:
            return self._drop(
                message,
                f"layer range {message.layer_start}..{message.layer_end} is outside "
                f"0..{spec.num_layers}",
            )
        expected_bytes = (
            len(message.block_ids) * (message.layer_end - message.layer_start)
            * spec.bytes_per_block_per_layer
        )
        if message.dtype != self.descriptor.dtype:
            return self._drop(message, f"dtype {message.dtype!r} is not {self.descriptor.dtype!r}")
        if len(data_frames) != 1:
            return self._drop(message, f"{len(data_frames)} data frames instead of 1")
        frame = data_frames[0].buffer
        if message.nbytes != expected_bytes or frame.nbytes != expected_bytes:
            return self._drop(
                message,
                f"header says {message.nbytes:,} bytes and the frame has {frame.nbytes:,}; "
                f"{len(message.block_ids)} blocks x {message.layer_end - message.layer_start} "
                f"layers need {expected_bytes:,}",
            )
        with self._lock:
            reason = self._ledger.check_write(
                message.transfer_id, identity, message.block_ids, message.layer_start,
                message.layer_end,
            )
            if reason is None:
                self.transport.apply(message, frame, self._kv_cache)
                seconds_left = self._ledger.record_write(
                    message.transfer_id, message.block_ids, message.layer_start,
                    message.layer_end, time.monotonic(), message.pace_s,
                )
                self._collect_actions()
                return Ack(message.transfer_id, message.seq, seconds_left)
        return self._refuse(message, reason)

    def _drop_other_write_kind(self, message: Data | Written) -> Reject:
        """A write of the kind the transport's strategy does not use (kvtransfer/strategies.py):
        Data for a DirectWrite transport, Written for a Streamed one."""
        return self._drop(
            message,
            f"the {self.transport.name} transport writes with "
            f"{self.transport.strategy.write_message.__name__} messages, not "
            f"{type(message).__name__}",
        )

    def _refuse(self, message: Data | Written, reason: str) -> Reject | None:
        """A write that failed the ledger's check. One for a committed transfer repeats a write
        that already landed (every block of every layer arrived, each (block, layer) pair is
        written once per transfer): it is dropped without a Reject, which would fail the sender's transfer."""
        with self._lock:
            repeated = self._ledger.committed(message.transfer_id)
        if not repeated:
            return self._drop(message, reason)
        logger.info(
            "KV channel: ignored a repeated %s %d of committed transfer %r",
            type(message).__name__, message.seq, message.transfer_id,
        )
        return None

    def _drop(self, message: Data | Written, reason: str) -> Reject:
        logger.warning(
            "KV channel: dropped %s %d of transfer %r: %s",
            type(message).__name__, message.seq, message.transfer_id, reason,
        )
        return Reject(message.transfer_id, message.seq, reason)
