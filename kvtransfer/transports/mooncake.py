"""mooncake: across hosts, CPU. The decode node registers its whole KV buffer with a Mooncake
transfer engine once (kvtransfer/transports/mooncake_engine.py) and publishes, in its descriptor,
the engine's session id (the channel's host and the engine's handshake port) and the buffer's
address. The prefill node starts an engine of its own, registering nothing (a stranger who
reaches its ports finds no memory to read), and writes each step's blocks from its KV buffer
straight into the decode node's buffer: one batched Mooncake write per step (per
1,024 segments where a step has more), one segment per (layer, key or value, run of consecutive
block ids), adjacent segments merged. Then it tells the decode node which blocks and layers
landed (Written), as shm does; the control messages stay on the ZeroMQ channel.

A DirectWrite transport (kvtransfer/strategies.py): the sender writes into the decode node's
memory itself, so a failed transfer's blocks are held until the sender abandons it or the grace
after its deadline has passed; that grace is at least Mooncake's write timeout, the longest a
step's write can still be landing (mooncake_engine.WRITE_TIMEOUT_S).

Host memory only: the non-CUDA Mooncake build reads and writes CPU buffers.

Who else can touch the KV: each engine answers only on its node's advertised host, and the
decode node's registered buffer is open to any process that reaches that host's Mooncake ports
(no secret covers them): mooncake_engine's docstring says what holds and what does not.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.strategies import DirectWrite, WriteStrategy
from pdserve.kvtransfer.transports.base import (
    Outgoing,
    ReceiverTransport,
    SenderTransport,
    WriteStep,
)
from pdserve.kvtransfer.transports.mooncake_engine import (
    PROTOCOL,
    WRITE_TIMEOUT_S,
    MooncakeEngine,
    host_of,
    local_address_toward,
    transfer_engine_class,
)
from pdserve.wire.roles import Role

# A step's write may still land this long after it started: Mooncake's timeout, plus a margin
# for the nanosecond per byte it adds (4 ms for a 4 MiB step).
STRATEGY = DirectWrite(write_timeout_s=WRITE_TIMEOUT_S + 1.0)


def check_host_memory(device: torch.device, side: Role, contiguous: bool = True) -> None:
    if device.type != "cpu" or not contiguous:
        raise ValueError(
            f"the mooncake KV transport moves a contiguous host-memory KV cache; the {side} "
            f"node's is on {device} (choose --kv-transport zmq for GPUs across hosts)"
        )


class MooncakeReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "mooncake"
    strategy: ClassVar[WriteStrategy] = STRATEGY

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        transfer_engine_class()  # MooncakeUnavailable now, naming what to install
        self._engine: MooncakeEngine | None = None

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache:
        check_host_memory(device, Role.DECODE)
        return KVCache(spec, num_blocks, device)

    def export(self, kv_cache: KVCache, channel_address: str) -> dict[str, Any]:
        buffer = kv_cache.buffer
        check_host_memory(buffer.device, Role.DECODE, buffer.is_contiguous())
        if self._engine is not None:
            raise RuntimeError("the mooncake KV transport registers one KV cache per node")
        engine = MooncakeEngine(host_of(channel_address))
        try:
            nbytes = buffer.numel() * buffer.element_size()
            engine.register(buffer.data_ptr(), nbytes)
        except BaseException:
            engine.close()
            raise
        self._engine = engine
        return {
            "session": engine.session_id,
            "protocol": PROTOCOL,
            "address": buffer.data_ptr(),
            "bytes": nbytes,
        }

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


class MooncakeSenderTransport(SenderTransport):
    name: ClassVar[str] = "mooncake"
    strategy: ClassVar[WriteStrategy] = STRATEGY

    def __init__(self) -> None:
        transfer_engine_class()  # MooncakeUnavailable now, naming what to install
        self._engine: MooncakeEngine | None = None
        self._peer_session = ""
        self._remote_address = 0
        self._remote_blocks = 0
        self._local_address = 0
        self._local_blocks = 0
        self._run_bytes = 0  # one block's keys (or values) of one layer

    def attach(self, descriptor: KVDescriptor, kv_cache: KVCache) -> None:
        check_host_memory(kv_cache.buffer.device, Role.PREFILL, kv_cache.buffer.is_contiguous())
        handle = descriptor.handle
        session, address, nbytes = handle.get("session"), handle.get("address"), handle.get("bytes")
        if (
            not isinstance(session, str)
            or not isinstance(address, int)
            or not isinstance(nbytes, int)
        ):
            raise TypeError("the mooncake descriptor lacks its session id, address and size")
        if handle.get("protocol") != PROTOCOL:
            raise ValueError(
                f"the decode node's Mooncake engine speaks {handle.get('protocol')!r}; this "
                f"prefill node speaks {PROTOCOL!r}"
            )
        if nbytes != descriptor.num_blocks * descriptor.spec.bytes_per_block:
            raise ValueError(f"the mooncake buffer's {nbytes:,} bytes do not match its block count")
        # Its source memory stays unregistered (TCP needs no registration to send from), so
        # this engine serves nothing to a peer that reaches its ports.
        self._engine = MooncakeEngine(local_address_toward(session.rsplit(":", 1)[0].strip("[]")))
        self._peer_session = session
        self._remote_address = address
        self._remote_blocks = descriptor.num_blocks
        self._local_address = kv_cache.buffer.data_ptr()
        self._local_blocks = kv_cache.num_blocks
        self._run_bytes = kv_cache.spec.bytes_per_block_per_layer // 2

    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing:
        sources, targets, lengths = self.segments(step)
        self._engine.write(self._peer_session, sources, targets, lengths)
        return Outgoing()

    def segments(self, step: WriteStep) -> tuple[list[int], list[int], list[int]]:
        """(source addresses, target addresses, lengths) of the step: the buffer is
        [layer, key/value, block, ...], so each run of blocks in one layer's keys or values is
        contiguous on both sides; segments adjacent on both sides are merged."""
        sources: list[int] = []
        targets: list[int] = []
        lengths: list[int] = []
        for layer in range(step.layer_start, step.layer_end):
            for kv in (0, 1):
                plane = 2 * layer + kv
                for run in step.runs:
                    source = self._local_address + self._offset(
                        plane, self._local_blocks, run.src_start
                    )
                    target = self._remote_address + self._offset(
                        plane, self._remote_blocks, run.dst_start
                    )
                    length = run.length * self._run_bytes
                    if (
                        lengths
                        and sources[-1] + lengths[-1] == source
                        and (targets[-1] + lengths[-1] == target)
                    ):
                        lengths[-1] += length
                        continue
                    sources.append(source)
                    targets.append(target)
                    lengths.append(length)
        return sources, targets, lengths

    def _offset(self, plane: int, num_blocks: int, block: int) -> int:
        return (plane * num_blocks + block) * self._run_bytes

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
