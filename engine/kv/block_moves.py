"""Moving whole KV blocks: the one API that copy-on-write, swap and the KV transports call.

Every buffer here is laid out as the KV cache's ([layers, 2, blocks, kv_heads, block_size,
head_dim], engine/kv/kv_cache.py), or is a layer range of one; a move is
dst[:, :, dst_id] = src[:, :, src_id] for each pair of ids.

  copy_blocks     within one buffer (copy-on-write). On CUDA one launch of the Triton kernel
                  (kernels/block_copy.py), which copies each block in place with no temporary;
                  elsewhere a torch gather and scatter.
  gather_blocks / scatter_blocks  blocks to / from one contiguous tensor in the buffer's own
                  layout (a staging batch, a transfer's packed frame); one index kernel on a GPU.
  copy_block_runs  between two buffers, one slice copy per run of consecutive ids (block_runs,
                  split_runs and run_block_ids plan the runs): the CPU transports' path.
  BlockStaging    between two buffers on one device or two (a GPU and host memory for swap, two
                  GPUs), in gathered batches.

Runs. A block's bytes for all layers are strided (one contiguous run per layer and key/value),
so a copy per block moves 2 x layers runs; pairs whose source and destination ids both step by
one merge into a run copied as one slice, which moves far longer contiguous runs. On GPUs, where
a copy per run is a launch (or a staged cross-device copy) per run, the transports gather each
step's blocks at once instead (BlockStaging, `run_block_ids`).

On the CPU, run copies go through numpy on byte views: one thread, GIL released, no OpenMP
team. A torch copy there starts an intra-op team of its own from the transfer thread, which then
competes with the forward pass's team for the same cores; on a busy 2-core machine shuffled-block
copies ran at 1.5 GB/s through torch and 5.5 GB/s through numpy, and consecutive runs as fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def copy_blocks(buffer: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copies whole blocks (all layers, keys and values) src -> dst within `buffer`, for
    copy-on-write; destinations are distinct and none is also a source."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=buffer.device)
    dst = torch.tensor([d for _, d in pairs], device=buffer.device)
    if buffer.device.type == "cuda":
        from pdserve.kernels.block_copy import (
            copy_blocks as copy_blocks_kernel,  # CPU never loads Triton
        )

        copy_blocks_kernel(buffer, src, dst)
        return
    movable = as_movable(buffer)
    movable[:, :, dst] = movable[:, :, src]


def as_movable(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for a one-byte float (an fp8 KV cache) its bytes (uint8, same
    shape): torch lacks some index ops on fp8 tensors (index_copy_ on the CPU), and whole
    blocks move as bytes anyway."""
    if tensor.element_size() == 1 and tensor.dtype.is_floating_point:
        return tensor.view(torch.uint8)
    return tensor


def gather_blocks(
    buffer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """buffer[:, :, block_ids] as one contiguous tensor: the buffer's own layout holding just
    those blocks, in that order (into `out` when given: contiguous, on the buffer's device).
    One index kernel on a GPU, whatever the ids."""
    if out is None:
        return as_movable(buffer).index_select(2, block_ids).view(buffer.dtype)
    torch.index_select(as_movable(buffer), 2, block_ids, out=as_movable(out))
    return out


def scatter_blocks(buffer: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """buffer[:, :, block_ids[i]] = blocks[:, :, i]: gather_blocks' inverse (ids distinct)."""
    as_movable(buffer).index_copy_(2, block_ids, as_movable(blocks))


@dataclass(frozen=True)
class BlockRun:
    src_start: int
    dst_start: int
    length: int


def block_runs(src_block_ids: list[int], dst_block_ids: list[int]) -> list[BlockRun]:
    """Runs covering every (src, dst) pair once, longest where ids are consecutive."""
    pairs = sorted(zip(src_block_ids, dst_block_ids))
    runs: list[BlockRun] = []
    for src, dst in pairs:
        if runs:
            last = runs[-1]
            if src == last.src_start + last.length and dst == last.dst_start + last.length:
                runs[-1] = BlockRun(last.src_start, last.dst_start, last.length + 1)
                continue
        runs.append(BlockRun(src, dst, 1))
    return runs


def split_runs(runs: list[BlockRun], max_blocks: int) -> list[list[BlockRun]]:
    """Groups of runs with at most `max_blocks` blocks each (a long run is cut)."""
    groups: list[list[BlockRun]] = [[]]
    room = max_blocks
    for run in runs:
        offset = 0
        while offset < run.length:
            if room == 0:
                groups.append([])
                room = max_blocks
            take = min(room, run.length - offset)
            groups[-1].append(BlockRun(run.src_start + offset, run.dst_start + offset, take))
            offset += take
            room -= take
    return [group for group in groups if group]


def run_block_ids(runs: list[BlockRun]) -> tuple[list[int], list[int]]:
    """(source ids, destination ids) of every block of the runs, in run order."""
    src_ids = [run.src_start + i for run in runs for i in range(run.length)]
    dst_ids = [run.dst_start + i for run in runs for i in range(run.length)]
    return src_ids, dst_ids


def copy_block_runs(
    dst: torch.Tensor, src: torch.Tensor, runs: list[BlockRun], non_blocking: bool = False
) -> None:
    """dst[:, :, run.dst] = src[:, :, run.src] for each run; dim 2 is the block dimension.
    Both tensors have the same dtype and a contiguous last dimension."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst_bytes, src_bytes = _byte_array(dst), _byte_array(src)
        for run in runs:
            np.copyto(
                dst_bytes[:, :, run.dst_start:run.dst_start + run.length],
                src_bytes[:, :, run.src_start:run.src_start + run.length],
            )
        return
    for run in runs:
        dst[:, :, run.dst_start:run.dst_start + run.length].copy_(
            src[:, :, run.src_start:run.src_start + run.length], non_blocking=non_blocking
        )


def _byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of the tensor's bytes (any dtype, bfloat16 included)."""
    return tensor.view(torch.uint8).numpy()


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
