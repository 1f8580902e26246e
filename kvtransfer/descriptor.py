"""What a decode node publishes about its registered KV buffer, and the check a prefill node
runs against it before its first write.

A descriptor names the transport, the decode node's channel address, a transport handle (a
shared-memory segment name, a CUDA IPC handle, or nothing for zmq), and everything that must
agree for bytes to mean the same on both sides: tensor-parallel size, layout, dtype, block
size, layers, KV heads (per rank), head dim and a model fingerprint. `num_blocks` is the decode
node's own count; the prefill side uses it to range-check destination block ids before sending
anything.

Tensor parallelism: a node of N ranks moves its node cache (engine/kv/shared_kv_cache.py), every
rank's shard, rank-major: prefill rank r's shard lands in decode rank r's. The pair must shard
alike, so a different `tensor_parallel_size` is refused first, on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from pdserve.engine.kv.kv_cache import KV_CACHE_LAYOUT, KVCacheSpec
from pdserve.kvtransfer.messages import KVProtocolError
from pdserve.wire.messages import unpack_map

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
MAX_DESCRIPTOR_BYTES = 64 << 10


class DescriptorMismatch(ValueError):
    """The prefill side's KV cache cannot write into the decode side's buffer."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in DTYPE_NAMES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"KV transfer supports dtypes {sorted(DTYPE_NAMES)}, not {dtype}")


@dataclass(frozen=True)
class KVDescriptor:
    transport: str
    node_id: str
    address: str
    layout: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    model_fingerprint: str
    tensor_parallel_size: int = 1
    handle: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_cache(
        cls,
        transport: str,
        node_id: str,
        address: str,
        spec: KVCacheSpec,
        num_blocks: int,
        model_fingerprint: str,
        handle: dict[str, Any],
        tensor_parallel_size: int = 1,
    ) -> KVDescriptor:
        """`spec` is the spec of the cache a transfer moves: a node cache's for several ranks
        (`tensor_parallel_size` x the model's layers)."""
        return cls(
            transport=transport,
            node_id=node_id,
            address=address,
            layout=KV_CACHE_LAYOUT,
            dtype=dtype_name(spec.dtype),
            block_size=spec.block_size,
            num_layers=spec.num_layers // tensor_parallel_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            num_blocks=num_blocks,
            model_fingerprint=model_fingerprint,
            tensor_parallel_size=tensor_parallel_size,
            handle=handle,
        )

    @property
    def spec(self) -> KVCacheSpec:
        """The spec of the buffer a transfer writes: every rank's layers."""
        return KVCacheSpec(
            num_layers=self.num_layers * self.tensor_parallel_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=DTYPE_NAMES[self.dtype],
        )

    def encode(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> KVDescriptor:
        fields = unpack_map(data, MAX_DESCRIPTOR_BYTES, "descriptor", KVProtocolError)
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(fields) != set(names):
            raise KVProtocolError(f"a descriptor is a map with exactly the fields {sorted(names)}")
        for name, annotation in names.items():
            value = fields[name]
            if annotation == "int":
                valid = isinstance(value, int) and not isinstance(value, bool) and value > 0
            elif annotation == "str":
                valid = isinstance(value, str)
            else:
                valid = isinstance(value, dict) and all(isinstance(k, str) for k in value)
            if not valid:
                raise KVProtocolError(f"descriptor field {name} is not a valid {annotation}")
        if fields["dtype"] not in DTYPE_NAMES:
            raise KVProtocolError(
                f"descriptor dtype {fields['dtype']!r} is not one of {sorted(DTYPE_NAMES)}"
            )
        return cls(**fields)


def check_compatible(
    descriptor: KVDescriptor,
    transport: str,
    spec: KVCacheSpec,
    model_fingerprint: str,
    tensor_parallel_size: int = 1,
) -> None:
    """Raises DescriptorMismatch naming every field that differs, with both values (only the
    tensor-parallel size when that differs: every per-rank field follows from it)."""
    if descriptor.tensor_parallel_size != tensor_parallel_size:
        raise DescriptorMismatch(
            f"KV descriptor mismatch: tensor_parallel_size is {descriptor.tensor_parallel_size} "
            f"on decode node {descriptor.node_id!r} and {tensor_parallel_size} on this prefill "
            "node; each prefill rank writes its KV shard to the same decode rank, so a "
            "prefill/decode pair must use the same tensor_parallel_size"
        )
    local = KVDescriptor.for_cache(
        transport, "", "", spec, descriptor.num_blocks, model_fingerprint, {},
        tensor_parallel_size,
    )
    compared = (
        "transport", "layout", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
        "model_fingerprint",
    )
    differences = [
        f"{name} is {getattr(descriptor, name)!r} on decode node {descriptor.node_id!r} and "
        f"{getattr(local, name)!r} on this prefill node"
        for name in compared
        if getattr(descriptor, name) != getattr(local, name)
    ]
    if differences:
        raise DescriptorMismatch("KV descriptor mismatch: " + "; ".join(differences))
