"""shm: one host, CPU. The decode node's KV buffer lives in a POSIX shared-memory segment named
after the node; the prefill node maps it and copies blocks straight into it, then tells the
decode node which blocks and layers landed (Written)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from pdserve.engine.block_moves import copy_block_runs
from pdserve.engine.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.strategies import DirectWrite, WriteStrategy
from pdserve.kvtransfer.transports.base import (
    Outgoing,
    ReceiverTransport,
    SenderTransport,
    WriteStep,
)
from pdserve.kvtransfer.transports.shm_segment import SharedSegment


class ShmReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "shm"
    strategy: ClassVar[WriteStrategy] = DirectWrite()

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self._segment: SharedSegment | None = None

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache:
        if device.type != "cpu":
            raise ValueError(f"the shm KV transport keeps the cache in host memory, not {device}")
        if self._segment is not None:
            raise RuntimeError("the shm KV transport allocates one KV cache per node")
        self._segment = SharedSegment.create(self.node_id, num_blocks * spec.bytes_per_block)
        return KVCache.over_buffer(spec, self._segment.payload)

    def export(self, kv_cache: KVCache, channel_address: str) -> dict[str, Any]:
        segment = self._segment
        if segment is None or kv_cache.buffer.data_ptr() != segment.payload.data_ptr():
            raise ValueError("the shm KV transport registers only the cache it allocated")
        # The owner's pid tells a restarted node's descriptor from its predecessor's.
        return {"segment": segment.path.name, "bytes": segment.payload.numel(), "pid": os.getpid()}

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None


class ShmSenderTransport(SenderTransport):
    name: ClassVar[str] = "shm"
    strategy: ClassVar[WriteStrategy] = DirectWrite()

    def __init__(self) -> None:
        self._segment: SharedSegment | None = None
        self._local: torch.Tensor | None = None
        self._remote: torch.Tensor | None = None

    def attach(self, descriptor: KVDescriptor, kv_cache: KVCache) -> None:
        if kv_cache.buffer.device.type != "cpu":
            raise ValueError("the shm KV transport copies from a host-memory KV cache")
        name, nbytes = descriptor.handle.get("segment"), descriptor.handle.get("bytes")
        if not isinstance(name, str) or not isinstance(nbytes, int):
            raise TypeError("the shm descriptor lacks its segment name and size")
        if nbytes != descriptor.num_blocks * descriptor.spec.bytes_per_block:
            raise ValueError(f"the shm segment's {nbytes:,} bytes do not match its block count")
        self._segment = SharedSegment.attach(name, nbytes)
        self._remote = KVCache.over_buffer(descriptor.spec, self._segment.payload).buffer
        self._local = kv_cache.buffer

    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing:
        layers = slice(step.layer_start, step.layer_end)
        copy_block_runs(self._remote[layers], self._local[layers], step.runs)
        return Outgoing()

    def close(self) -> None:
        self._remote = None
        self._local = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
