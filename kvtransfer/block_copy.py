"""Copying KV blocks between buffers shaped [layers, 2, blocks, kv_heads, block_size, head_dim].

A block's bytes for all layers are strided (one contiguous run per layer and key/value), so a
copy per block moves 2 x layers runs; pairs whose source and destination ids both step by one
merge into a run copied as one slice, which moves far longer contiguous runs. Every copy is one
slice copy per run, with no gather into a temporary: the CPU transports' path. On GPUs, where a
copy per run is a launch (or a staged cross-device copy) per run, the transports gather each
step's blocks at once instead (engine.kv_cache.BlockStaging, `run_block_ids`).

On the CPU the copies go through numpy on byte views: one thread, GIL released, no OpenMP
team. A torch copy here starts an intra-op team of its own from the transfer thread, which then
competes with the forward pass's team for the same cores; on a busy 2-core machine shuffled-block
copies ran at 1.5 GB/s through torch and 5.5 GB/s through numpy, and consecutive runs as fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
