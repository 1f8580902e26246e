"""cuda_ipc: one host, GPUs. The decode node shares its GPU KV buffer by a CUDA IPC handle; the
prefill node opens it and copies device-to-device on a side stream that first waits for the
compute stream as it was when `write` was called. After a write's last step it records an event
on the side stream and waits for it before sending Written, so Written always follows the bytes.

Both processes must see the decode node's GPU; it is found by its UUID, not its index (each
process may number devices differently). The decode node keeps the buffer alive until exit.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer.block_copy import copy_block_runs
from kvtransfer.descriptor import KVDescriptor
from kvtransfer.transports.base import Outgoing, ReceiverTransport, SenderTransport, WriteStep


def device_identity(device: torch.device) -> str:
    properties = torch.cuda.get_device_properties(device)
    uuid = getattr(properties, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return "pci:{}:{}:{}".format(
        getattr(properties, "pci_domain_id", "?"),
        getattr(properties, "pci_bus_id", "?"),
        getattr(properties, "pci_device_id", "?"),
    )


def local_index_of(identity: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_identity(torch.device("cuda", index)) == identity:
            return index
    raise RuntimeError(
        f"the decode node's GPU {identity} is not visible to this process; cuda_ipc needs both "
        "nodes to see it (check CUDA_VISIBLE_DEVICES)"
    )


class CudaIpcReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "cuda_ipc"
    direct_write: ClassVar[bool] = True

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache:
        if device.type != "cuda":
            raise ValueError(f"the cuda_ipc KV transport needs a CUDA device, not {device}")
        return KVCache(spec, num_blocks, device)

    def export(self, kv_cache: KVCache) -> dict[str, Any]:
        buffer = kv_cache.buffer
        if buffer.device.type != "cuda" or not buffer.is_contiguous():
            raise ValueError("the cuda_ipc KV transport shares a contiguous CUDA buffer")
        torch.cuda.synchronize(buffer.device)
        (
            _device_index, handle, storage_bytes, storage_offset_bytes, ref_counter_handle,
            ref_counter_offset, event_handle, event_sync_required,
        ) = buffer.untyped_storage()._share_cuda_()
        return {
            "device": device_identity(buffer.device),
            "handle": bytes(handle),
            "storage_bytes": int(storage_bytes),
            "storage_offset_bytes": int(storage_offset_bytes),
            "tensor_offset": int(buffer.storage_offset()),
            "ref_counter_handle": bytes(ref_counter_handle),
            "ref_counter_offset": int(ref_counter_offset),
            "event_handle": bytes(event_handle or b""),
            "event_sync_required": bool(event_sync_required),
        }


class CudaIpcSenderTransport(SenderTransport):
    name: ClassVar[str] = "cuda_ipc"
    direct_write: ClassVar[bool] = True

    def __init__(self) -> None:
        self._local: torch.Tensor | None = None
        self._remote: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    def attach(self, descriptor: KVDescriptor, kv_cache: KVCache) -> None:
        local = kv_cache.buffer
        if local.device.type != "cuda":
            raise ValueError("the cuda_ipc KV transport copies from a CUDA KV cache")
        handle = descriptor.handle
        remote_index = local_index_of(str(handle["device"]))
        storage = torch.UntypedStorage._new_shared_cuda(
            remote_index,
            handle["handle"],
            handle["storage_bytes"],
            handle["storage_offset_bytes"],
            handle["ref_counter_handle"],
            handle["ref_counter_offset"],
            handle["event_handle"],
            handle["event_sync_required"],
        )
        shape = descriptor.spec.buffer_shape(descriptor.num_blocks)
        stride = torch.empty(shape, device="meta").stride()
        self._remote = torch.empty(0, dtype=local.dtype, device=f"cuda:{remote_index}").set_(
            storage, handle["tensor_offset"], shape, stride
        )
        self._local = local
        self._stream = torch.cuda.Stream(device=local.device)

    def on_write(self) -> torch.cuda.Event:
        """The compute stream's position now: the side stream waits for it before copying."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._local.device))
        return ready

    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing:
        layers = slice(step.layer_start, step.layer_end)
        with torch.cuda.stream(self._stream):
            if isinstance(ready, torch.cuda.Event):
                self._stream.wait_event(ready)
            copy_block_runs(self._remote[layers], self._local[layers], step.runs, non_blocking=True)
        return Outgoing()

    def finish_write(self, ready: object | None) -> None:
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._remote = None
        self._local = None
        self._stream = None
