"""shm: one host, CPU. The decode node's KV buffer lives in a POSIX shared-memory segment named
after the node (or, for a tensor-parallel node, its node cache's segment); the prefill node maps it and copies blocks straight into it, then tells the
decode node which blocks and layers landed (Written)."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from pdserve.engine.kv.block_moves import copy_block_runs
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.kv.shared_kv_cache import SharedKVCache
from pdserve.engine.kv.shared_segment import SharedSegment
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.strategies import DirectWrite, WriteStrategy
from pdserve.kvtransfer.transports.base import (
    Outgoing,
    ReceiverTransport,
    SenderTransport,
    WriteStep,
)


class ShmReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "shm"
    strategy: ClassVar[WriteStrategy] = DirectWrite()

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self._allocated: SharedKVCache | None = None

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache:
        if device.type != "cpu":
            raise ValueError(f"the shm KV transport keeps the cache in host memory, not {device}")
        if self._allocated is not None:
            raise RuntimeError("the shm KV transport allocates one KV cache per node")
        self._allocated = SharedKVCache.create(self.node_id, spec, num_blocks)
        return self._allocated

    def export(self, kv_cache: KVCache, channel_address: str) -> dict[str, Any]:
        if not isinstance(kv_cache, SharedKVCache):
            raise TypeError("the shm KV transport registers a KV cache in shared memory")
        # The owner's pid tells a restarted node's descriptor from its predecessor's.
        nbytes = kv_cache.segment.payload.numel()
        return {"segment": kv_cache.name, "bytes": nbytes, "pid": os.getpid()}

    def close(self) -> None:
        if self._allocated is not None:
            self._allocated.close()
            self._allocated = None


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
