"""Whole-block copies within the KV buffer [num_layers, 2, num_blocks, num_kv_heads, block_size,
head_dim], for copy-on-write (engine/kv/block_moves.py launches it on CUDA).

The buffer is seen as [planes, blocks, block_numel]: its planes are its (layer, key/value)
pairs. Grid (num_moves, planes, ceil(block_numel / CHUNK)): each program copies CHUNK elements of
one block of one plane, from src_ids[i] to dst_ids[i], with no temporary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import CACHE_DTYPES, FP8_CACHE_DTYPES, check_index, kernel_runs_on
from pdserve.kernels.reference import copy_blocks_reference

CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(
    buffer_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_plane,
    stride_block,
    block_numel,
    CHUNK: tl.constexpr,
):
    move = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    elements = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = elements < block_numel
    src_block = tl.load(src_ids_ptr + move).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + move).to(tl.int64)
    plane_start = buffer_ptr + plane * stride_plane
    data = tl.load(plane_start + src_block * stride_block + elements, mask=mask)
    tl.store(plane_start + dst_block * stride_block + elements, data, mask=mask)


def _check_buffer(buffer: torch.Tensor) -> None:
    if buffer.dim() != 6 or buffer.shape[1] != 2:
        raise ValueError(
            "buffer must be [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim], "
            f"got {tuple(buffer.shape)}"
        )
    if not buffer.is_contiguous() or buffer.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"buffer must be contiguous with a dtype of {CACHE_DTYPES}, got {buffer.dtype}"
        )


def copy_blocks(buffer: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Block src_ids[i] -> block dst_ids[i], every layer, keys and values.

    dst_ids must be distinct and none may also be a source (the moves would then depend on
    their order); checked on the host, so give host or small tensors.
    """
    _check_buffer(buffer)
    check_index("src_ids", src_ids, 1, buffer.device)
    check_index("dst_ids", dst_ids, 1, buffer.device)
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"{src_ids.shape[0]} sources for {dst_ids.shape[0]} destinations")
    sources, destinations = set(src_ids.tolist()), dst_ids.tolist()
    if len(set(destinations)) != len(destinations) or sources & set(destinations):
        raise ValueError(
            f"destinations must be distinct and not sources: {src_ids.tolist()} -> {destinations}"
        )
    if src_ids.numel() == 0:
        return
    if buffer.dtype in FP8_CACHE_DTYPES:  # a byte copy: no fp8 support needed on the device
        buffer = buffer.view(torch.uint8)
    if not kernel_runs_on(_copy_blocks_kernel, buffer.device):
        copy_blocks_reference(buffer, src_ids, dst_ids)
        return
    block_numel = buffer.stride(2)
    grid = (src_ids.shape[0], buffer.shape[0] * 2, triton.cdiv(block_numel, CHUNK))
    _copy_blocks_kernel[grid](
        buffer, src_ids, dst_ids, buffer.stride(1), buffer.stride(2), block_numel, CHUNK=CHUNK
    )

