"""The paged KV cache: one preallocated buffer, per-layer views, blocks of `block_size` tokens.

Layout: [num_layers, 2 (key, value), num_blocks, num_kv_heads, block_size, head_dim]. A token's
slot is `block_id * block_size + offset`; `key_cache(layer)[block_id, :, offset]` is its key.
Head-major blocks keep each (block, head) run of keys contiguous, so attention gathers whole
runs and reads every byte once.
Keeping it one allocation makes it one thing to share (shared memory, CUDA IPC) and register:
`KVCache.over_buffer` builds a cache over a buffer someone else allocated (a tensor over shared
memory, a GPU buffer shared by IPC handle) instead of allocating one.
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

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Keys and values of one block in one layer: the unit a transfer moves."""
        return self.bytes_per_block // self.num_layers

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)


KV_CACHE_LAYOUT = "layer,kv,block,kv_head,token,head_dim"


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block: {spec.bytes_per_block} bytes per block needed"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.buffer = torch.zeros(spec.buffer_shape(num_blocks), dtype=spec.dtype, device=device)

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
        """Copies whole blocks (all layers, keys and values) src -> dst, for copy-on-write."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.buffer.device)
        dst = torch.tensor([d for _, d in pairs], device=self.buffer.device)
        self.buffer[:, :, dst] = self.buffer[:, :, src]


def gather_blocks(
    buffer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """buffer[:, :, block_ids] as one contiguous tensor: the buffer's own layout holding just
    those blocks, in that order (into `out` when given: contiguous, on the buffer's device).
    One index kernel on a GPU, whatever the ids."""
    if out is None:
        return buffer.index_select(2, block_ids)
    return torch.index_select(buffer, 2, block_ids, out=out)


def scatter_blocks(buffer: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """buffer[:, :, block_ids[i]] = blocks[:, :, i]: gather_blocks' inverse (ids distinct)."""
    buffer.index_copy_(2, block_ids, blocks)


class BlockStaging:
    """Copies whole blocks between two buffers of one layout ([layers, 2, blocks, ...]), on one
    device or two: a GPU's KV buffer and host memory (swap), two GPUs (peer copies).

    Each batch of at most `max_batch_bytes` is gathered on the source's device into one
    contiguous tensor, crosses in one copy, and is scattered on the destination's device -
    instead of a strided copy (and its temporaries) per block. Between a GPU and the host the
    batch goes through a reusable host staging buffer, pinned, so the one copy is a DMA. Work is
    issued on the current streams; `copy` returns once the host buffers it read or wrote may be
    used again (device-to-host: the bytes are in `dst`; host-to-device: they have left the host,
    and the scatter is queued on the destination's current stream).
    """

    def __init__(self, max_batch_bytes: int = 64 << 20) -> None:
        if max_batch_bytes < 1:
            raise ValueError(f"max_batch_bytes must be positive, got {max_batch_bytes}")
        self.max_batch_bytes = max_batch_bytes
        self._host: torch.Tensor | None = None

    def copy(
        self, dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]
    ) -> None:
        """dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]] for every i (dst_ids distinct)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
        if src.dtype != dst.dtype or src.shape[:2] != dst.shape[:2] or (
            src.shape[3:] != dst.shape[3:]
        ):
            raise ValueError(
                f"buffers differ: {src.dtype} {tuple(src.shape)} -> {dst.dtype} {tuple(dst.shape)}"
            )
        block_bytes = src[:, :, :1].numel() * src.element_size()
        per_batch = max(1, self.max_batch_bytes // max(block_bytes, 1))
        for start in range(0, len(src_ids), per_batch):
            self._copy_batch(
                dst, dst_ids[start:start + per_batch], src, src_ids[start:start + per_batch]
            )

    def _copy_batch(
        self, dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]
    ) -> None:
        src_index = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        dst_index = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
        if src.device == dst.device:
            scatter_blocks(dst, dst_index, gather_blocks(src, src_index))
        elif dst.device.type == "cpu":
            staging = self._host_staging(src, len(src_ids))
            staging.copy_(gather_blocks(src, src_index), non_blocking=True)
            _wait_for_current_stream(src.device)
            scatter_blocks(dst, dst_index, staging)
        elif src.device.type == "cpu":
            staging = gather_blocks(src, src_index, out=self._host_staging(dst, len(src_ids)))
            moved = staging.to(dst.device, non_blocking=True)
            _wait_for_current_stream(dst.device)
            scatter_blocks(dst, dst_index, moved)
        else:  # two GPUs: torch orders the peer copy after both devices' current streams
            moved = gather_blocks(src, src_index).to(dst.device, non_blocking=True)
            scatter_blocks(dst, dst_index, moved)

    def _host_staging(self, device_buffer: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A contiguous host view shaped like `num_blocks` blocks of `device_buffer`; the
        buffer behind it grows to the largest batch seen and is pinned for a CUDA peer."""
        shape = (*device_buffer.shape[:2], num_blocks, *device_buffer.shape[3:])
        nbytes = device_buffer.element_size() * num_blocks * device_buffer[:, :, :1].numel()
        if self._host is None or self._host.numel() < nbytes:
            self._host = torch.empty(
                nbytes, dtype=torch.uint8, pin_memory=device_buffer.device.type == "cuda"
            )
        return self._host[:nbytes].view(device_buffer.dtype).view(shape)

    def release(self) -> None:
        """Frees the host staging buffer (it is made again on the next copy)."""
        self._host = None


def _wait_for_current_stream(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
