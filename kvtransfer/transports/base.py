"""What a transport adds to the common channel: how the KV buffer is shared and how bytes move.

The channel (a ZeroMQ DEALER on the prefill side, a ROUTER on the decode side) carries every
control message for every transport (see kvtransfer/messages.py); a transport decides where the
decode node's buffer lives and who writes the bytes into it.

Who calls what, and when:

ReceiverTransport (decode side)
  allocate_kv_cache   the receiver's owner, once at start-up: the buffer the engine runs on.
  export              register(), once, after the channel is bound (given the address it
                      advertises): the transport part of the descriptor (segment name, CUDA IPC
                      handle, Mooncake session); {} when nothing but the channel is needed.
  apply               the receiver's I/O thread, for each Data message whose header the ledger
                      accepted: scatter the frame into the destination blocks. Called only for a
                      Streamed transport (a DirectWrite one's Data messages are rejected).
  close               close(), once.

SenderTransport (prefill side)
  attach              connect(), once, after the descriptor check: map the decode node's buffer.
  on_write            write(), on the owner's thread: capture what the copy must wait for (the
                      compute stream on a GPU); returns a token handed to run_step/finish_write.
  run_step            the sender's I/O thread, for each step of a write in order, and only
                      before the transfer's deadline: copy the step's blocks into the mapped
                      buffer (DirectWrite) or pack them and return the frame to send (Streamed).
  finish_write        the I/O thread, through DirectWrite.finish_job after a write's last step:
                      return once the copies are in the decode node's memory (a GPU event); then
                      Written is sent.
  close               close(), once.

Each transport names its write strategy (kvtransfer/strategies.py) in `strategy`, both halves
the same: DirectWrite transports (shm, cuda_ipc, mooncake, inprocess) let the sender copy into
the decode node's memory itself, and the ledger's late-write rule then holds failed transfers'
blocks until the sender abandons them or the grace after the deadline has passed; the Streamed
transport (zmq) sends the bytes for the receiver to write.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pdserve.engine.kv.block_moves import BlockRun, block_runs, split_runs
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.messages import Data
from pdserve.kvtransfer.strategies import WriteStrategy


@dataclass(frozen=True)
class WriteStep:
    """Some blocks of a write over a layer range: one Data message or one direct copy."""

    runs: list[BlockRun]
    layer_start: int
    layer_end: int
    nbytes: int

    @property
    def dst_block_ids(self) -> list[int]:
        return [run.dst_start + i for run in self.runs for i in range(run.length)]


@dataclass
class Outgoing:
    """What a step sends: data frames (none for a direct write), and what to do on its Ack."""

    frames: list[Any] = field(default_factory=list)
    on_ack: Callable[[], None] | None = None


def plan_steps(
    spec: KVCacheSpec,
    src_block_ids: list[int],
    dst_block_ids: list[int],
    max_step_bytes: int,
    layers: range | None = None,
) -> list[WriteStep]:
    """Cuts a write of `layers` (default: all) into steps of at most `max_step_bytes` (or one
    block-layer if larger): whole blocks with all those layers where they fit, else one block
    in groups of layers."""
    layers = layers if layers is not None else range(spec.num_layers)
    layer_bytes = spec.bytes_per_block_per_layer
    bytes_per_block = layer_bytes * len(layers)
    blocks_per_step = max(1, max_step_bytes // bytes_per_block)
    layers_per_step = len(layers)
    if bytes_per_block > max_step_bytes:
        layers_per_step = max(1, max_step_bytes // layer_bytes)
    steps = []
    for group in split_runs(block_runs(src_block_ids, dst_block_ids), blocks_per_step):
        num_blocks = sum(run.length for run in group)
        for layer_start in range(layers.start, layers.stop, layers_per_step):
            layer_end = min(layer_start + layers_per_step, layers.stop)
            nbytes = num_blocks * (layer_end - layer_start) * layer_bytes
            steps.append(WriteStep(group, layer_start, layer_end, nbytes))
    return steps


class ReceiverTransport(abc.ABC):
    name: ClassVar[str]
    strategy: ClassVar[WriteStrategy]

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache:
        return KVCache(spec, num_blocks, device)

    @abc.abstractmethod
    def export(self, kv_cache: KVCache, channel_address: str) -> dict[str, Any]: ...

    def apply(self, message: Data, frame: memoryview, kv_cache: KVCache) -> None:
        raise NotImplementedError(f"the {self.name} transport takes no data frames")

    def close(self) -> None:
        """Nothing to release by default."""


class SenderTransport(abc.ABC):
    name: ClassVar[str]
    strategy: ClassVar[WriteStrategy]

    @abc.abstractmethod
    def attach(self, descriptor: KVDescriptor, kv_cache: KVCache) -> None: ...

    def on_write(self) -> object | None:
        return None

    @abc.abstractmethod
    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing: ...

    def finish_write(self, ready: object | None) -> None:
        """Direct-write copies done by run_step are synchronous by default."""

    def close(self) -> None:
        """Nothing to release by default."""
