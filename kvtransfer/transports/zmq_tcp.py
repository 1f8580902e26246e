"""zmq: across hosts. The sender packs each step's blocks (a layer range of a group of blocks)
into one contiguous staging buffer and sends it as a raw frame after a Data header, without a
copy in pyzmq; the receiver's I/O thread checks the header against the ledger and scatters the
frame into the destination blocks straight from the received message.

Staging buffers are reused only after their message's Ack (the receiver has applied it, so
libzmq no longer reads them); the channel bounds unacknowledged bytes, so they are bounded too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.cpu_allocator import keep_freed_memory_for_reuse
from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.block_copy import BlockRun, block_runs, copy_block_runs
from kvtransfer.descriptor import KVDescriptor
from kvtransfer.messages import Data
from kvtransfer.transports.base import Outgoing, ReceiverTransport, SenderTransport, WriteStep


def packed_view(
    raw: torch.Tensor, spec: KVCacheSpec, num_blocks: int, num_layers: int
) -> torch.Tensor:
    """[layers, 2, blocks, kv_heads, block_size, head_dim] view of a byte tensor."""
    shape = spec.buffer_shape(num_blocks)
    return raw.view(spec.dtype).view((num_layers, *shape[1:]))


class ZmqReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "zmq"
    direct_write: ClassVar[bool] = False

    def export(self, kv_cache: KVCache) -> dict[str, Any]:
        if kv_cache.buffer.device.type == "cpu":
            keep_freed_memory_for_reuse()  # received messages are malloc()ed: keep them warm
        return {}

    def apply(self, message: Data, frame: memoryview, kv_cache: KVCache) -> None:
        num_blocks = len(message.block_ids)
        packed = packed_view(
            torch.frombuffer(frame, dtype=torch.uint8),
            kv_cache.spec,
            num_blocks,
            message.layer_end - message.layer_start,
        ).to(kv_cache.buffer.device, non_blocking=False)
        copy_block_runs(
            kv_cache.buffer[message.layer_start:message.layer_end],
            packed,
            block_runs(list(range(num_blocks)), message.block_ids),
        )


class ZmqSenderTransport(SenderTransport):
    name: ClassVar[str] = "zmq"
    direct_write: ClassVar[bool] = False

    def __init__(self, staging_bytes: int) -> None:
        self._staging_bytes = staging_bytes
        self._free_staging: list[torch.Tensor] = []
        self._local: torch.Tensor | None = None
        self._spec: KVCacheSpec | None = None

    def attach(self, descriptor: KVDescriptor, kv_cache: KVCache) -> None:
        self._local = kv_cache.buffer
        self._spec = kv_cache.spec

    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing:
        pooled = step.nbytes <= self._staging_bytes
        if pooled and self._free_staging:
            staging = self._free_staging.pop()
        else:
            staging = torch.empty(max(step.nbytes, self._staging_bytes), dtype=torch.uint8)
        num_blocks = sum(run.length for run in step.runs)
        packed = packed_view(
            staging[:step.nbytes], self._spec, num_blocks, step.layer_end - step.layer_start
        )
        packing_runs, position = [], 0
        for run in step.runs:
            packing_runs.append(BlockRun(run.src_start, position, run.length))
            position += run.length
        copy_block_runs(packed, self._local[step.layer_start:step.layer_end], packing_runs)
        frame = memoryview(staging[:step.nbytes].numpy())

        def return_staging() -> None:
            if pooled:
                self._free_staging.append(staging)

        return Outgoing(frames=[frame], on_ack=return_staging)

    def close(self) -> None:
        self._free_staging.clear()
        self._local = None
