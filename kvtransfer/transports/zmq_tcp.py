"""zmq: across hosts. The sender packs each step's blocks (a layer range of a group of blocks)
into one contiguous staging buffer and sends it as a raw frame after a Data header, without a
copy in pyzmq; the receiver's I/O thread checks the header against the ledger and scatters the
frame into the destination blocks straight from the received message.

Staging buffers are reused only after their message's Ack (the receiver has applied it, so
libzmq no longer reads them); the channel bounds unacknowledged bytes, so they are bounded too.

On a GPU both sides copy on a side stream of their own, never the compute stream: the sender's
side stream first waits for the compute stream as it was when `write` was called, gathers the
step's blocks on the device (engine.kv.block_moves.gather_blocks) and copies them in one DMA into a
pinned staging buffer, then waits for that copy alone; the receiver copies the frame to the
device, scatters it into the target blocks and waits for that before the Ack. On the CPU the
copies are numpy's (engine.kv.block_moves.copy_block_runs).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pdserve.engine.cpu.cpu_allocator import keep_freed_memory_for_reuse
from pdserve.engine.kv.block_moves import (
    BlockRun,
    block_runs,
    copy_block_runs,
    gather_blocks,
    run_block_ids,
    scatter_blocks,
)
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.messages import Data
from pdserve.kvtransfer.strategies import Streamed, WriteStrategy
from pdserve.kvtransfer.transports.base import (
    Outgoing,
    ReceiverTransport,
    SenderTransport,
    WriteStep,
)


def packed_view(
    raw: torch.Tensor, spec: KVCacheSpec, num_blocks: int, num_layers: int
) -> torch.Tensor:
    """[layers, 2, blocks, kv_heads, block_size, head_dim] view of a byte tensor."""
    shape = spec.buffer_shape(num_blocks)
    return raw.view(spec.dtype).view((num_layers, *shape[1:]))


class ZmqReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "zmq"
    strategy: ClassVar[WriteStrategy] = Streamed()

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self._stream: torch.cuda.Stream | None = None

    def export(self, kv_cache: KVCache, channel_address: str) -> dict[str, Any]:
        if kv_cache.buffer.device.type == "cpu":
            keep_freed_memory_for_reuse()  # received messages are malloc()ed: keep them warm
        else:
            self._stream = torch.cuda.Stream(device=kv_cache.buffer.device)
        return {}

    def apply(self, message: Data, frame: memoryview, kv_cache: KVCache) -> None:
        num_blocks = len(message.block_ids)
        packed = packed_view(
            torch.frombuffer(frame, dtype=torch.uint8),
            kv_cache.spec,
            num_blocks,
            message.layer_end - message.layer_start,
        )
        layers = kv_cache.buffer[message.layer_start:message.layer_end]
        if layers.device.type == "cpu":
            copy_block_runs(layers, packed, block_runs(list(range(num_blocks)), message.block_ids))
            return
        if self._stream is None:  # export() makes it; a cache never exported gets one here
            self._stream = torch.cuda.Stream(device=layers.device)
        with torch.cuda.stream(self._stream):
            block_ids = torch.tensor(message.block_ids, dtype=torch.long, device=layers.device)
            scatter_blocks(layers, block_ids, packed.to(layers.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # the frame is released, and the blocks used, only after this


class ZmqSenderTransport(SenderTransport):
    name: ClassVar[str] = "zmq"
    strategy: ClassVar[WriteStrategy] = Streamed()

    def __init__(self, staging_bytes: int) -> None:
        self._staging_bytes = staging_bytes
        self._free_staging: list[torch.Tensor] = []
        self._local: torch.Tensor | None = None
        self._spec: KVCacheSpec | None = None
        self._stream: torch.cuda.Stream | None = None

    def attach(self, descriptor: KVDescriptor, kv_cache: KVCache) -> None:
        self._local = kv_cache.buffer
        self._spec = kv_cache.spec
        if self._local.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self._local.device)

    def on_write(self) -> torch.cuda.Event | None:
        """On a GPU, the compute stream's position now: the side stream waits for it."""
        if self._stream is None:
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._local.device))
        return ready

    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing:
        pooled = step.nbytes <= self._staging_bytes
        if pooled and self._free_staging:
            staging = self._free_staging.pop()
        else:
            staging = torch.empty(
                max(step.nbytes, self._staging_bytes),
                dtype=torch.uint8,
                pin_memory=self._stream is not None,
            )
        num_blocks = sum(run.length for run in step.runs)
        packed = packed_view(
            staging[:step.nbytes], self._spec, num_blocks, step.layer_end - step.layer_start
        )
        layers = self._local[step.layer_start:step.layer_end]
        if self._stream is None:
            packing_runs, position = [], 0
            for run in step.runs:
                packing_runs.append(BlockRun(run.src_start, position, run.length))
                position += run.length
            copy_block_runs(packed, layers, packing_runs)
        else:
            self._stage_from_device(packed, layers, step, ready)
        frame = memoryview(staging[:step.nbytes].numpy())

        def return_staging() -> None:
            if pooled:
                self._free_staging.append(staging)

        return Outgoing(frames=[frame], on_ack=return_staging)

    def _stage_from_device(
        self, packed: torch.Tensor, layers: torch.Tensor, step: WriteStep, ready: object | None
    ) -> None:
        """One gather of the step's blocks on the GPU, one copy into pinned `packed`, on the
        side stream; returns once the bytes are in `packed`."""
        src_ids, _ = run_block_ids(step.runs)
        with torch.cuda.stream(self._stream):
            if isinstance(ready, torch.cuda.Event):
                self._stream.wait_event(ready)
            block_ids = torch.tensor(src_ids, dtype=torch.long, device=layers.device)
            packed.copy_(gather_blocks(layers, block_ids), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._free_staging.clear()
        self._local = None
        self._stream = None
