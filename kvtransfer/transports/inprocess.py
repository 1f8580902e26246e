"""inprocess: the instant transfer, a test double. The decode and the prefill side live in one
process and the sender copies each step straight into the receiver's KV buffer (DirectWrite):
the shm transport without a shared-memory segment. The channel (sockets, ledger, deadlines,
every message) is the real one, so a test drives whole transfers without a second process.

The descriptor's handle holds the buffer's address and size and this process's id; a sender in
any other process refuses it. The receiving transport holds the buffer for as long as it lives,
so the address stays valid while a sender may still copy. Host-memory caches only.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, ClassVar

import torch

from pdserve.engine.kv.block_moves import copy_block_runs
from pdserve.engine.kv.kv_cache import KVCache
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.strategies import DirectWrite, WriteStrategy
from pdserve.kvtransfer.transports.base import (
    Outgoing,
    ReceiverTransport,
    SenderTransport,
    WriteStep,
)


class InProcessReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "inprocess"
    strategy: ClassVar[WriteStrategy] = DirectWrite()

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self._buffer: torch.Tensor | None = None

    def export(self, kv_cache: KVCache, channel_address: str) -> dict[str, Any]:
        buffer = kv_cache.buffer
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(
                f"the inprocess KV transport shares a contiguous host-memory KV cache, not one "
                f"on {buffer.device}"
            )
        self._buffer = buffer
        return {
            "pid": os.getpid(),
            "address": buffer.data_ptr(),
            "bytes": buffer.numel() * buffer.element_size(),
        }


class InProcessSenderTransport(SenderTransport):
    name: ClassVar[str] = "inprocess"
    strategy: ClassVar[WriteStrategy] = DirectWrite()

    def __init__(self) -> None:
        self._local: torch.Tensor | None = None
        self._remote: torch.Tensor | None = None

    def attach(self, descriptor: KVDescriptor, kv_cache: KVCache) -> None:
        if kv_cache.buffer.device.type != "cpu":
            raise ValueError("the inprocess KV transport copies from a host-memory KV cache")
        pid, address, nbytes = (descriptor.handle.get(key) for key in ("pid", "address", "bytes"))
        if pid != os.getpid():
            raise ValueError(
                f"the inprocess KV transport connects within one process: the decode node's "
                f"buffer is in process {pid}, this is process {os.getpid()}"
            )
        if not isinstance(address, int) or nbytes != (
            descriptor.num_blocks * descriptor.spec.bytes_per_block
        ):
            raise ValueError(f"the inprocess descriptor's {nbytes} bytes do not match its blocks")
        raw = torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), dtype=torch.uint8)
        self._remote = KVCache.over_buffer(descriptor.spec, raw).buffer
        self._local = kv_cache.buffer

    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing:
        layers = slice(step.layer_start, step.layer_end)
        copy_block_runs(self._remote[layers], self._local[layers], step.runs)
        return Outgoing()

    def close(self) -> None:
        self._remote = None
        self._local = None
