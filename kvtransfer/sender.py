"""The prefill side of the KV channel: a DEALER socket to one decode node, served by one I/O
thread that runs every write's copy steps.

A transfer on this side: `write` queues a job -> the first job sends Begin and waits for Grant
(deadline: grant_timeout_s) -> granted (deadline: the time Begin was sent plus the seconds left
the decode node granted, then the time each acknowledged write was sent plus the seconds left
its Ack names, so never later than the decode node's own) -> each job is cut into
steps of at most step_bytes, run in order, at most one step per transfer per round so acks,
cancels and other transfers are served in between. No step starts after the deadline. The
transport's write strategy (kvtransfer/strategies.py) says what each step and each job's end
send: a Streamed step sends Data, and steps wait while unacknowledged bytes would pass
max_inflight_bytes (backpressure); a DirectWrite job sends Written after its last step's copies
have landed. The transfer ends COMPLETE on Committed, or FAILED on
Refuse, Reject, Cancel, abort or the deadline; a failed transfer that sent Begin sends Abandon,
which tells the decode node that nothing of it will be copied any more - except after a copy
step that raised (a network write that timed out may still be landing): then the decode node
keeps the blocks until its deadline plus the write timeout.

With `PDSERVE_KV_FAULTS` set at construction, Data and Written messages pass through a fault
injector (kvtransfer/faults.py) that drops, duplicates or holds them.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import sys
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import zmq

from pdserve.engine.kv.kv_cache import KVCache
from pdserve.kvtransfer.base import KVSender, TransferEvent, TransferKind
from pdserve.kvtransfer.descriptor import KVDescriptor, check_compatible
from pdserve.kvtransfer.events import EventBoard
from pdserve.kvtransfer.faults import FaultInjector
from pdserve.kvtransfer.messages import (
    MAX_TRANSFER_ID_CHARS,
    Abandon,
    Ack,
    Begin,
    Cancel,
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
from pdserve.kvtransfer.outgoing import InFlight, OutgoingTransfer, SenderConfig, WriteJob
from pdserve.kvtransfer.transports.base import SenderTransport, WriteStep, plan_steps
from pdserve.kvtransfer.transports.registry import sender_transport
from pdserve.kvtransfer.wakeup import Wakeup

logger = logging.getLogger(__name__)

MAX_IDLE_POLL_S = 0.5
RECENT_TRANSFERS_REMEMBERED = 4096
CLOSE_LINGER_MS = 200


class ChannelSender(KVSender):
    def __init__(
        self, transport: str | SenderTransport, config: SenderConfig | None = None
    ) -> None:
        self.config = config or SenderConfig()
        if isinstance(transport, str):
            transport = sender_transport(transport, self.config.step_bytes)
        self.transport = transport
        self._strategy = transport.strategy
        self._board = EventBoard({TransferKind.COMPLETE, TransferKind.FAILED})
        self._commands: queue.SimpleQueue[tuple[str, str, WriteJob | None]] = queue.SimpleQueue()
        self._wakeup = Wakeup()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._descriptor: KVDescriptor | None = None
        self._kv_cache: KVCache | None = None
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._in_flight: dict[int, InFlight] = {}
        self._in_flight_bytes = 0
        self._next_seq = 0
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._faults = FaultInjector.from_environ("KV sender")

    def connect(self, descriptor: KVDescriptor, kv_cache: KVCache, model_fingerprint: str) -> None:
        if self._thread is not None:
            raise RuntimeError("a KV sender connects to one decode node, once")
        check_compatible(
            descriptor, self.transport.name, kv_cache.spec, model_fingerprint, kv_cache.num_ranks
        )
        self.transport.attach(descriptor, kv_cache)
        self._descriptor = descriptor
        self._kv_cache = kv_cache
        # Created here so a bad address fails connect(); from start() on only the I/O thread
        # touches the socket (thread start is the memory barrier zmq asks for on hand-over).
        self._context = zmq.Context()
        self._socket = self.config.cluster_auth.secure_client(self._context.socket(zmq.DEALER))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        try:
            self._socket.connect(descriptor.address)
        except zmq.ZMQError as error:
            self._socket.close()
            self._context.term()
            raise ValueError(f"cannot connect to {descriptor.address!r}: {error}") from None
        self._thread = threading.Thread(
            target=self._serve, name=f"kv-sender-{descriptor.node_id}", daemon=True
        )
        self._thread.start()

    def write(
        self,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        pace_s: float = 0.0,
        layer_start: int = 0,
        layer_end: int | None = None,
    ) -> None:
        src, dst = list(src_block_ids), list(dst_block_ids)
        if not (math.isfinite(pace_s) and pace_s >= 0):
            raise ValueError(f"pace_s is {pace_s!r}; expected a finite time >= 0")
        if self._descriptor is None:
            raise RuntimeError("connect() the KV sender before writing")
        num_layers = self._kv_cache.spec.num_layers
        layer_end = num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= num_layers:
            raise ValueError(
                f"layer range {layer_start}..{layer_end} is outside 0..{num_layers} or empty"
            )
        if not 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS:
            raise ValueError(f"a transfer id has 1-{MAX_TRANSFER_ID_CHARS} characters")
        if not src or len(src) != len(dst):
            raise ValueError(f"a write needs equal, non-empty block lists ({len(src)}, {len(dst)})")
        if len(set(dst)) != len(dst):
            raise ValueError(f"write for request {transfer_id!r} lists a destination block twice")
        for name, ids, limit in (
            ("source", src, self._kv_cache.num_blocks),
            ("destination", dst, self._descriptor.num_blocks),
        ):
            bad = [b for b in ids if not 0 <= b < limit]
            if bad:
                raise ValueError(f"{name} block ids {bad[:8]} are outside 0..{limit - 1}")
        job = WriteJob(src, dst, range(layer_start, layer_end), self.transport.on_write(), pace_s)
        self._commands.put(("write", transfer_id, job))
        self._wakeup.wake()

    def abort(self, transfer_id: str) -> None:
        self._commands.put(("abort", transfer_id, None))
        self._wakeup.wake()

    def poll(self) -> list[TransferEvent]:
        return self._board.take_all()

    def wait(self, transfer_id: str, timeout: float) -> TransferEvent:
        return self._board.wait(transfer_id, timeout)

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
        if self._faults is not None:
            self._faults.close()

    def _serve(self) -> None:
        self._lower_priority()
        socket = self._socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wakeup.read_fd, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                try:
                    self._serve_once(poller)
                except Exception:  # a bug in one round must not strand every transfer
                    logger.exception("KV sender: I/O round failed")
            for transfer in list(self._transfers.values()):
                self._fail(transfer, f"the KV sender for request {transfer.transfer_id!r} closed")
        finally:
            socket.close(linger=CLOSE_LINGER_MS)
            self._context.term()

    def _lower_priority(self) -> None:
        """Per-thread nice values are Linux's; elsewhere setpriority would renice the process."""
        if not self.config.io_thread_niceness or not sys.platform.startswith("linux"):
            return
        thread_id = threading.get_native_id()
        try:
            niceness = os.getpriority(os.PRIO_PROCESS, thread_id) + self.config.io_thread_niceness
            os.setpriority(os.PRIO_PROCESS, thread_id, min(niceness, 19))
        except OSError as error:
            logger.debug("KV sender: I/O thread keeps its priority: %s", error)

    def _serve_once(self, poller: zmq.Poller) -> None:
        self._run_commands()
        if self._closing.is_set():
            return
        busy = self._run_one_step_each()
        if self._faults is not None:
            self._faults.flush(time.monotonic())
        self._expire(time.monotonic())
        ready = dict(poller.poll(0 if busy else self._idle_timeout_ms()))
        if self._wakeup.read_fd in ready:
            self._wakeup.drain()
        while self._socket.poll(0, zmq.POLLIN):
            self._handle_reply(self._socket.recv_multipart())

    def _send(self, message: Any, frames: list[Any] = ()) -> bool:
        parts = [encode_header(message), *frames]
        if self._faults is not None and isinstance(message, (Data, Written)):
            return self._faults.send("frame", self._send_parts, parts, time.monotonic())
        return self._send_parts(parts)

    def _send_parts(self, parts: list[Any]) -> bool:
        try:
            self._socket.send_multipart(parts, copy=len(parts) == 1, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _run_commands(self) -> None:
        while True:
            try:
                command, transfer_id, job = self._commands.get_nowait()
            except queue.Empty:
                return
            transfer = self._transfers.get(transfer_id)
            if command == "abort":
                if transfer is not None:
                    self._fail(
                        transfer,
                        f"KV transfer for request {transfer_id!r} was aborted by the prefill node",
                    )
                continue
            if transfer is None and transfer_id in self._finished:
                logger.warning(
                    "KV sender: dropped a write for request %r, whose transfer is already %s",
                    transfer_id, self._finished[transfer_id],
                )
                continue
            if transfer is None:
                now = time.monotonic()
                transfer = OutgoingTransfer(transfer_id, now, now + self.config.grant_timeout_s)
                self._transfers[transfer_id] = transfer
                if not self._send(Begin(transfer_id)):
                    self._fail(transfer, self._unreachable(transfer_id))
                    continue
            transfer.jobs.append(job)

    def _run_one_step_each(self) -> bool:
        """Runs at most one step per granted transfer; True while some step is ready."""
        more_ready = False
        for transfer in list(self._transfers.values()):
            if transfer.granted_blocks is None or not transfer.jobs:
                continue
            job = transfer.jobs[0]
            if job.steps is None and not self._start_job(transfer, job):
                continue
            step = job.steps[0]
            if self._window_full(step):
                continue
            if time.monotonic() >= transfer.deadline:
                continue  # _expire fails it
            job.steps.popleft()
            job_done = not job.steps
            try:
                outgoing = self.transport.run_step(step, job.ready)
                written = None
                if job_done:
                    written = self._strategy.finish_job(
                        self.transport, transfer.transfer_id, job.dst_block_ids, job.layers,
                        job.ready, self._take_seq, job.pace_s,
                    )
            except Exception as error:  # fail this transfer, serve the others
                logger.exception("KV sender: a copy step failed")
                self._fail(
                    transfer,
                    f"KV transfer for request {transfer.transfer_id!r}: {error}",
                    copy_may_be_landing=True,
                )
                continue
            data = self._strategy.step_message(
                transfer.transfer_id, step, self._descriptor.dtype, self._take_seq, job.pace_s
            )
            if data is not None and not self._send_tracked(
                transfer, data, step.nbytes, outgoing.on_ack, outgoing.frames
            ):
                continue
            if job_done:
                transfer.jobs.popleft()
                for block_id in job.dst_block_ids:
                    transfer.written_layers[block_id] = (
                        transfer.written_layers.get(block_id, 0) | job.layer_mask
                    )
                if written is not None and not self._send_tracked(transfer, written, 0, None):
                    continue
            more_ready = more_ready or bool(transfer.jobs)
        return more_ready

    def _send_tracked(
        self,
        transfer: OutgoingTransfer,
        message: Data | Written,
        nbytes: int,
        on_ack: Any,
        frames: list[Any] = (),
    ) -> bool:
        """Sends a write message and tracks it until its Ack; False (the transfer failed)
        when the decode node does not take it."""
        sent_at = time.monotonic()
        if not self._send(message, frames):
            self._fail(transfer, self._unreachable(transfer.transfer_id))
            return False
        self._in_flight[message.seq] = InFlight(transfer.transfer_id, nbytes, on_ack, sent_at)
        self._in_flight_bytes += nbytes
        transfer.unacked.add(message.seq)
        return True

    def _start_job(self, transfer: OutgoingTransfer, job: WriteJob) -> bool:
        outside = [b for b in job.dst_block_ids if b not in transfer.granted_blocks]
        again = [
            b for b in job.dst_block_ids if transfer.written_layers.get(b, 0) & job.layer_mask
        ]
        if outside or again:
            self._fail(
                transfer,
                f"write for request {transfer.transfer_id!r} targets blocks "
                f"{(outside or again)[:8]} that "
                + (
                    "the decode node did not reserve for it" if outside
                    else f"were written already in layers {job.layers.start}..{job.layers.stop}"
                ),
            )
            return False
        job.steps = deque(
            plan_steps(
                self._kv_cache.spec, job.src_block_ids, job.dst_block_ids, self.config.step_bytes,
                job.layers,
            )
        )
        return True

    def _window_full(self, step: WriteStep) -> bool:
        """Only Data messages are in flight: a DirectWrite transport's window never fills."""
        if self._in_flight_bytes == 0:
            return False
        return self._in_flight_bytes + step.nbytes > self.config.max_inflight_bytes

    def _take_seq(self) -> int:
        self._next_seq += 1
        return self._next_seq

    def _expire(self, now: float) -> None:
        for transfer in list(self._transfers.values()):
            if now < transfer.deadline:
                continue
            if transfer.granted_blocks is None:
                reason = f"no grant within {self.config.grant_timeout_s:.2f} s"
            else:
                reason = "the decode node acknowledged no write before its deadline"
            self._fail(
                transfer,
                f"KV transfer for request {transfer.transfer_id!r} to decode node "
                f"{self._descriptor.node_id!r} failed: {reason}",
            )

    def _idle_timeout_ms(self) -> int:
        deadlines = [t.deadline for t in self._transfers.values()]
        if self._faults is not None and self._faults.next_due() is not None:
            deadlines.append(self._faults.next_due())
        if not deadlines:
            return int(MAX_IDLE_POLL_S * 1000)
        return max(0, min(int((min(deadlines) - time.monotonic()) * 1000) + 1, 1000))

    def _handle_reply(self, frames: list[bytes]) -> None:
        try:
            message = decode_header(frames[0])
        except KVProtocolError as error:
            logger.warning("KV sender: dropped a malformed reply: %s", error)
            return
        transfer = self._transfers.get(message.transfer_id)
        if isinstance(message, Ack):
            self._acknowledge(message.seq, message.seconds_left)
        elif transfer is None:
            return  # a reply about a transfer this side has already finished
        elif isinstance(message, Grant):
            if transfer.granted_blocks is None:
                transfer.granted_blocks = frozenset(message.block_ids)
                transfer.deadline = transfer.begin_sent_at + message.seconds_left
        elif isinstance(message, Committed):
            self._finish(transfer, "complete")
            self._board.post([TransferEvent(transfer.transfer_id, TransferKind.COMPLETE)])
        elif isinstance(message, (Refuse, Reject, Cancel)):
            self._fail(
                transfer,
                f"decode node {self._descriptor.node_id!r} ended the KV transfer for request "
                f"{transfer.transfer_id!r}: {message.reason}",
            )
        else:
            logger.warning("KV sender: dropped a %s reply", type(message).__name__)

    def _acknowledge(self, seq: int, seconds_left: float) -> None:
        """The write landed: its bytes leave the window, and the transfer's deadline moves
        to the time it was sent plus the seconds the decode node says are left."""
        in_flight = self._in_flight.pop(seq, None)
        if in_flight is None:
            return
        self._in_flight_bytes -= in_flight.nbytes
        transfer = self._transfers.get(in_flight.transfer_id)
        if transfer is not None:
            transfer.unacked.discard(seq)
            if transfer.granted_blocks is not None:
                transfer.deadline = max(transfer.deadline, in_flight.sent_at + seconds_left)
        if in_flight.on_ack is not None:
            in_flight.on_ack()

    def _fail(
        self, transfer: OutgoingTransfer, error: str, copy_may_be_landing: bool = False
    ) -> None:
        """Ends the transfer and tells the decode node nothing of it will land any more
        (Abandon), unless a copy step raised: a network write that timed out may still be
        landing, so the decode node must keep the blocks until its deadline plus the write
        timeout (the late-write rule, kvtransfer/ledger.py)."""
        self._finish(transfer, "failed")
        for seq in transfer.unacked:
            in_flight = self._in_flight.pop(seq, None)
            if in_flight is not None:
                self._in_flight_bytes -= in_flight.nbytes  # its staging buffer is not reused
        if not copy_may_be_landing:
            self._send(Abandon(transfer.transfer_id, error))
        logger.warning("%s", error)
        self._board.post([TransferEvent(transfer.transfer_id, TransferKind.FAILED, error)])

    def _finish(self, transfer: OutgoingTransfer, outcome: str) -> None:
        self._transfers.pop(transfer.transfer_id, None)
        self._finished[transfer.transfer_id] = outcome
        while len(self._finished) > RECENT_TRANSFERS_REMEMBERED:
            self._finished.popitem(last=False)

    def _unreachable(self, transfer_id: str) -> str:
        return (
            f"KV transfer for request {transfer_id!r}: decode node {self._descriptor.node_id!r} "
            "is not accepting messages"
        )
