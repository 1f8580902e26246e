"""Host memory for preempted sequences' KV: a block pool in CPU memory (pinned on CUDA).

The scheduler allocates and frees host blocks (accounting only); the engine performs the copies
`swap_out` (device blocks -> host blocks) and `swap_in` (host -> device) at the start of a step,
before anything writes the device blocks that a swap-out just gave up. Both report how many
bytes they moved and how long it took (to the end of the copies on the device), which the
preemption cost model learns from.

A swap moves all its blocks in batches (engine.kv.block_moves.BlockStaging): one gather on the
source side, one copy through a pinned staging buffer on CUDA, one scatter on the other side.

Invariant: a host block is either free or in exactly one swapped sequence's `host_block_table`
(`check_integrity`).
"""

from __future__ import annotations

import time

import torch

from pdserve.engine.kv.block_moves import BlockStaging
from pdserve.engine.kv.kv_cache import KVCache


class SwapSpace:
    def __init__(self, kv_cache: KVCache, num_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.num_blocks = num_blocks
        self.bytes_per_block = kv_cache.spec.bytes_per_block
        self._free = list(range(num_blocks - 1, -1, -1))
        self._buffer: torch.Tensor | None = None
        self._staging = BlockStaging()
        self.bytes_out_total = 0
        self.bytes_in_total = 0

    @classmethod
    def for_budget(cls, kv_cache: KVCache, swap_space_bytes: int) -> SwapSpace:
        return cls(kv_cache, swap_space_bytes // kv_cache.spec.bytes_per_block)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` host blocks, or None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, host_block_ids: list[int]) -> None:
        self._free.extend(reversed(host_block_ids))

    def swap_out(self, pairs: list[tuple[int, int]]) -> tuple[int, float]:
        """Copies (device block, host block) pairs to host memory; returns (bytes, seconds)."""
        return self._copy(pairs, to_host=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> tuple[int, float]:
        """Copies (host block, device block) pairs back to the device; returns (bytes, seconds)."""
        return self._copy(pairs, to_host=False)

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool) -> tuple[int, float]:
        if not pairs:
            return 0, 0.0
        host = self._host_buffer()
        device = self.kv_cache.buffer
        sources, destinations = [src for src, _ in pairs], [dst for _, dst in pairs]
        started = time.perf_counter()
        if to_host:
            self._staging.copy(host, destinations, device, sources)
        else:
            self._staging.copy(device, destinations, host, sources)
        if device.is_cuda:
            torch.cuda.current_stream(device.device).synchronize()
        seconds = time.perf_counter() - started
        moved = len(pairs) * self.bytes_per_block
        if to_host:
            self.bytes_out_total += moved
        else:
            self.bytes_in_total += moved
        return moved, seconds

    def _host_buffer(self) -> torch.Tensor:
        """Allocated on first use: an unused swap space costs no memory."""
        if self._buffer is None:
            spec = self.kv_cache.spec
            self._buffer = torch.empty(
                spec.buffer_shape(self.num_blocks),
                dtype=spec.dtype,
                pin_memory=self.kv_cache.buffer.is_cuda,
            )
        return self._buffer

    def check_integrity(self, host_block_tables: list[list[int]]) -> None:
        held = [block for table in host_block_tables for block in table]
        everything = sorted(held + self._free)
        if everything != list(range(self.num_blocks)):
            raise RuntimeError(
                f"swap space accounting broken: {len(self._free)} free + {len(held)} held "
                f"!= {self.num_blocks} host blocks (or a block is counted twice)"
            )
