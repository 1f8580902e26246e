"""cuda_ipc: one host, GPUs. The decode node shares its GPU KV buffer by a CUDA IPC handle; the
prefill node opens it and copies device-to-device on a side stream that first waits for the
compute stream as it was when `write` was called. Each step is one gather of its blocks, one
copy (a peer copy when the decode node's GPU is another), one scatter into the target blocks
(engine.kv.block_moves.BlockStaging). After a write's last step it records an event on the side
streams and waits for it before sending Written, so Written always follows the bytes.

A CUDA IPC handle covers a cudaMalloc allocation. PyTorch's expandable segments
(`expandable_segments:True` in PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF) map memory with
the virtual memory API instead, which such a handle cannot share with an unrelated process, so
the decode node refuses that setting when it allocates and registers its buffer.

Both processes must see the decode node's GPU; it is found by its UUID, not its index (each
process numbers devices differently: `pdserve serve` lists a node's own GPU first, then its
peers', in its CUDA_VISIBLE_DEVICES; commands/launcher.py). The decode node keeps the buffer
alive until exit.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from pdserve.engine.kv.block_moves import BlockStaging, run_block_ids
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.kvtransfer.descriptor import KVDescriptor
from pdserve.kvtransfer.strategies import DirectWrite, WriteStrategy
from pdserve.kvtransfer.transports.base import (
    Outgoing,
    ReceiverTransport,
    SenderTransport,
    WriteStep,
)


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
    """This process's index of the GPU with `identity` (device_identity's); RuntimeError naming
    what this process sees when it is not visible here."""
    visible = [device_identity(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    if identity in visible:
        return visible.index(identity)
    raise RuntimeError(
        f"the decode node's GPU {identity} is not visible to this process, which sees "
        f"{visible or 'no GPU'} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r});"
        " cuda_ipc needs the prefill node to see every decode node's GPU"
    )


ALLOCATOR_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments_setting(environ: dict[str, str] | None = None) -> str | None:
    """`NAME=value` of the allocator setting that turns expandable segments on, or None."""
    environ = os.environ if environ is None else environ
    for name in ALLOCATOR_SETTINGS:
        value = environ.get(name, "")
        for option in value.split(","):
            key, _, setting = option.partition(":")
            if key.strip() == "expandable_segments" and setting.strip().lower() == "true":
                return f"{name}={value}"
    return None


def check_shareable_allocator(environ: dict[str, str] | None = None) -> None:
    """ValueError when this process's CUDA allocator makes memory a CUDA IPC handle cannot
    share with another process."""
    setting = expandable_segments_setting(environ)
    if setting is not None:
        raise ValueError(
            f"the cuda_ipc KV transport cannot share a KV buffer allocated with PyTorch's "
            f"expandable segments ({setting!r} in the decode node's environment): CUDA IPC "
            "handles cover only cudaMalloc allocations. Remove expandable_segments:True for "
            "the decode node, or choose another KV transport (--kv-transport zmq)"
        )


class CudaIpcReceiverTransport(ReceiverTransport):
    name: ClassVar[str] = "cuda_ipc"
    strategy: ClassVar[WriteStrategy] = DirectWrite()

    def allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device
    ) -> KVCache:
        if device.type != "cuda":
            raise ValueError(f"the cuda_ipc KV transport needs a CUDA device, not {device}")
        check_shareable_allocator()
        return KVCache(spec, num_blocks, device)

    def export(self, kv_cache: KVCache, channel_address: str) -> dict[str, Any]:
        buffer = kv_cache.buffer
        if buffer.device.type != "cuda" or not buffer.is_contiguous():
            raise ValueError("the cuda_ipc KV transport shares a contiguous CUDA buffer")
        check_shareable_allocator()
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
    strategy: ClassVar[WriteStrategy] = DirectWrite()

    def __init__(self) -> None:
        self._local: torch.Tensor | None = None
        self._remote: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._remote_stream: torch.cuda.Stream | None = None
        self._staging = BlockStaging()

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
        if self._remote.device != local.device:
            self._remote_stream = torch.cuda.Stream(device=self._remote.device)

    def on_write(self) -> torch.cuda.Event:
        """The compute stream's position now: the side stream waits for it before copying."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._local.device))
        return ready

    def run_step(self, step: WriteStep, ready: object | None) -> Outgoing:
        layers = slice(step.layer_start, step.layer_end)
        src_ids, dst_ids = run_block_ids(step.runs)
        with torch.cuda.stream(self._stream):
            if isinstance(ready, torch.cuda.Event):
                self._stream.wait_event(ready)
            if self._remote_stream is None:
                self._staging.copy(self._remote[layers], dst_ids, self._local[layers], src_ids)
            else:  # the scatter runs on the decode GPU, on a side stream of its own
                with torch.cuda.stream(self._remote_stream):
                    self._staging.copy(
                        self._remote[layers], dst_ids, self._local[layers], src_ids
                    )
        return Outgoing()

    def finish_write(self, ready: object | None) -> None:
        for stream in (self._stream, self._remote_stream):
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                done.synchronize()

    def close(self) -> None:
        for stream in (self._stream, self._remote_stream):
            if stream is not None:
                stream.synchronize()
        self._remote = None
        self._local = None
        self._stream = None
        self._remote_stream = None
