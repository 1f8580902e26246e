"""The paged KV cache: one preallocated buffer, per-layer views, blocks of `block_size` tokens.

Layout: [num_layers, 2 (key, value), num_blocks, num_kv_heads, block_size, head_dim]. A token's
slot is `block_id * block_size + offset`; `key_cache(layer)[block_id, :, offset]` is its key.
Head-major blocks keep each (block, head) run of keys contiguous, so attention gathers whole
runs and reads every byte once.
Keeping it one allocation makes it one thing to share (shared memory, CUDA IPC) and register:
`KVCache.over_buffer` builds a cache over a buffer someone else allocated (a tensor over shared
memory, a GPU buffer shared by IPC handle) instead of allocating one. Whole blocks move between
caches and buffers through engine/kv/block_moves.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.cpu.huge_pages import zeroed_cpu_bytes
from pdserve.engine.kv.block_moves import copy_blocks


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Keys and values of one block in one layer: the unit a transfer moves."""
        return self.bytes_per_block // self.num_layers

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)


KV_CACHE_LAYOUT = "layer,kv,block,kv_head,token,head_dim"


def check_holds_a_block(spec: KVCacheSpec, num_blocks: int) -> None:
    """ValueError, with the bytes one block needs, for a cache sized to no block."""
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block: {spec.bytes_per_block} bytes per block needed"
        )


class KVCache:
    num_ranks: int = 1  # tensor-parallel shards the buffer holds (engine/kv/shared_kv_cache.py)

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        check_holds_a_block(spec, num_blocks)
        self.spec = spec
        self.num_blocks = num_blocks
        shape = spec.buffer_shape(num_blocks)
        if device.type == "cpu":  # on huge pages: decode attention reads it block by block
            memory = zeroed_cpu_bytes(spec.bytes_per_block * num_blocks)
            self.buffer = memory.view(spec.dtype).view(shape)
        else:
            self.buffer = torch.zeros(shape, dtype=spec.dtype, device=device)

    @classmethod
    def over_buffer(cls, spec: KVCacheSpec, buffer: torch.Tensor) -> KVCache:
        """A cache over an existing buffer, which it neither copies nor clears.

        `buffer` is either already shaped [num_layers, 2, num_blocks, num_kv_heads, block_size,
        head_dim] with the spec's dtype, or a flat byte (uint8) tensor whose size is a whole
        number of blocks (shared memory mapped as bytes). It must be contiguous: transports
        address blocks by offset.
        """
        if not buffer.is_contiguous():
            raise ValueError("a KV cache buffer must be contiguous")
        if buffer.dim() == 1 and buffer.dtype == torch.uint8 and spec.dtype != torch.uint8:
            if buffer.numel() % spec.bytes_per_block:
                raise ValueError(
                    f"a buffer of {buffer.numel():,} bytes is not a whole number of "
                    f"{spec.bytes_per_block:,}-byte KV blocks"
                )
            num_blocks = buffer.numel() // spec.bytes_per_block
            buffer = buffer.view(spec.dtype).view(spec.buffer_shape(num_blocks))
        if buffer.dtype != spec.dtype:
            raise ValueError(f"KV buffer dtype is {buffer.dtype}; the spec says {spec.dtype}")
        num_blocks = buffer.shape[2] if buffer.dim() == 6 else 0
        if num_blocks < 1 or tuple(buffer.shape) != spec.buffer_shape(num_blocks):
            raise ValueError(
                f"KV buffer shape is {tuple(buffer.shape)}; the spec needs "
                f"{spec.buffer_shape(1)} with 1 or more blocks in dimension 2"
            )
        cache = cls.__new__(cls)
        cache.spec = spec
        cache.num_blocks = num_blocks
        cache.buffer = buffer
        return cache

    def key_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, num_kv_heads, block_size, head_dim] view of one layer's keys."""
        return self.buffer[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole blocks (all layers, keys and values) src -> dst, for copy-on-write
        (engine.kv.block_moves.copy_blocks)."""
        copy_blocks(self.buffer, pairs)
