"""The paged KV cache: one preallocated buffer, per-layer views, blocks of `block_size` tokens.

Layout: [num_layers, 2 (key, value), num_blocks, num_kv_heads, block_size, head_dim]. A token's
slot is `block_id * block_size + offset`; `key_cache(layer)[block_id, :, offset]` is its key.
Head-major blocks keep each (block, head) run of keys contiguous, so attention gathers whole
runs and reads every byte once.
Keeping it one allocation makes it one thing to share (shared memory, CUDA IPC) and register.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block: {spec.bytes_per_block} bytes per block needed"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.buffer = torch.zeros(
            spec.num_layers, 2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim,
            dtype=spec.dtype, device=device,
        )

    def key_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, num_kv_heads, block_size, head_dim] view of one layer's keys."""
        return self.buffer[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole blocks (all layers, keys and values) src -> dst, for copy-on-write."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.buffer.device)
        dst = torch.tensor([d for _, d in pairs], device=self.buffer.device)
        self.buffer[:, :, dst] = self.buffer[:, :, src]
