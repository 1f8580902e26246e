"""Whole-block moves in the KV buffer [num_layers, 2, num_blocks, num_kv_heads, block_size,
head_dim]: copy (copy-on-write), gather (pack blocks for a transfer) and scatter (unpack).

One kernel serves all three. Both sides are seen as [planes, blocks, block_numel]: the buffer's
planes are its (layer, key/value) pairs; a packed tensor [n, num_layers, 2, ...] keeps each
block's whole payload contiguous (one block = one transfer unit), so there block i of plane p
starts at (i * planes + p) * block_numel. Grid (num_moves, planes, ceil(block_numel / CHUNK)):
each program copies CHUNK elements of one block of one plane, from src_ids[i] to dst_ids[i].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import CACHE_DTYPES, check_index, kernel_runs_on
from kernels.reference import (
    copy_blocks_reference,
    gather_blocks_reference,
    scatter_blocks_reference,
)

CHUNK = 1024


@triton.jit
def _move_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_src_plane,
    stride_src_block,
    stride_dst_plane,
    stride_dst_block,
    block_numel,
    CHUNK: tl.constexpr,
):
    move = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    elements = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = elements < block_numel
    src_block = tl.load(src_ids_ptr + move).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + move).to(tl.int64)
    data = tl.load(
        src_ptr + plane * stride_src_plane + src_block * stride_src_block + elements, mask=mask
    )
    tl.store(
        dst_ptr + plane * stride_dst_plane + dst_block * stride_dst_block + elements,
        data,
        mask=mask,
    )


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


def _launch(src, dst, src_ids, dst_ids, src_strides, dst_strides, planes, block_numel) -> None:
    grid = (src_ids.shape[0], planes, triton.cdiv(block_numel, CHUNK))
    _move_blocks_kernel[grid](
        src, dst, src_ids, dst_ids, *src_strides, *dst_strides, block_numel, CHUNK=CHUNK
    )


def _buffer_strides(buffer: torch.Tensor) -> tuple[int, int]:
    """(plane stride, block stride) of the buffer seen as [planes, blocks, block_numel]."""
    return buffer.stride(1), buffer.stride(2)


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
    if not kernel_runs_on(_move_blocks_kernel, buffer.device):
        copy_blocks_reference(buffer, src_ids, dst_ids)
        return
    planes = buffer.shape[0] * 2
    strides = _buffer_strides(buffer)
    _launch(buffer, buffer, src_ids, dst_ids, strides, strides, planes, buffer.stride(2))


def gather_blocks(
    buffer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """-> out [len(block_ids), num_layers, 2, num_kv_heads, block_size, head_dim], contiguous:
    block_ids[i]'s whole payload (every layer, keys and values) at out[i]."""
    _check_buffer(buffer)
    check_index("block_ids", block_ids, 1, buffer.device)
    num_layers, _, _, *block_shape = buffer.shape
    shape = (block_ids.shape[0], num_layers, 2, *block_shape)
    out = torch.empty(shape, dtype=buffer.dtype, device=buffer.device) if out is None else out
    _check_packed(out, shape, buffer)
    if block_ids.numel() == 0:
        return out
    if not kernel_runs_on(_move_blocks_kernel, buffer.device):
        out.copy_(gather_blocks_reference(buffer, block_ids))
        return out
    planes, block_numel = num_layers * 2, buffer.stride(2)
    positions = torch.arange(block_ids.shape[0], device=buffer.device)
    _launch(
        buffer, out, block_ids, positions, _buffer_strides(buffer),
        (block_numel, planes * block_numel), planes, block_numel,
    )
    return out


def scatter_blocks(buffer: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Inverse of gather_blocks: packed[i] -> block block_ids[i] (ids distinct)."""
    _check_buffer(buffer)
    check_index("block_ids", block_ids, 1, buffer.device)
    num_layers, _, _, *block_shape = buffer.shape
    _check_packed(packed, (block_ids.shape[0], num_layers, 2, *block_shape), buffer)
    if block_ids.numel() == 0:
        return
    if not kernel_runs_on(_move_blocks_kernel, buffer.device):
        scatter_blocks_reference(buffer, block_ids, packed)
        return
    planes, block_numel = num_layers * 2, buffer.stride(2)
    positions = torch.arange(block_ids.shape[0], device=buffer.device)
    _launch(
        packed, buffer, positions, block_ids, (block_numel, planes * block_numel),
        _buffer_strides(buffer), planes, block_numel,
    )


def _check_packed(packed: torch.Tensor, shape: tuple[int, ...], buffer: torch.Tensor) -> None:
    if tuple(packed.shape) != shape or not packed.is_contiguous():
        raise ValueError(f"packed blocks must be contiguous {shape}, got {tuple(packed.shape)}")
    if packed.dtype != buffer.dtype or packed.device != buffer.device:
        raise ValueError(
            f"packed blocks are {packed.dtype} on {packed.device}; "
            f"buffer is {buffer.dtype} on {buffer.device}"
        )
