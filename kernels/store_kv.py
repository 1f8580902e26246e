"""store_kv: writes one step's keys and values into the paged cache by slot.

One program copies TOKENS tokens, all their KV heads ([TOKENS, kv_heads, head_dim], padded to
powers of two and masked), each to `block = slot // block_size`, `offset = slot % block_size`.
A slot of -1 marks padding (CUDA-graph batches, dropped tokens): that token writes nothing.
An fp8 cache stores each element as fp8(clamp(x / scale, +-448)), computed in fp32, with the
layer's `k_scale` for keys and `v_scale` for values (kernels/reference.py's `to_cache`). The
kernel rounds to e4m3 itself (nearest, ties to even, as torch's cast), so the cast to fp8 is
exact: Triton 3.9's interpreter rounds fp8 casts wrongly (31.0 -> 16.0 where a carry reaches
the exponent, ties away from even), and this way the interpreter's bytes are the GPU's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import (
    FP8_CACHE_DTYPES,
    FP8_E4M3_MAX,
    check_index,
    check_paged_cache,
    check_rows,
    check_rows_for_cache,
    check_scales,
    kernel_runs_on,
    next_power_of_2,
)
from pdserve.kernels.reference import store_kv_reference

TOKENS_PER_PROGRAM = 8


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in
    fp32: the spacing at x's exponent (never below the subnormals' 2^-9) is a power of two, and
    adding then subtracting 1.5 x 2^23 rounds |x| / spacing to an integer. x's sign bit is
    copied onto the result, so a negative x that rounds to zero gives -0.0 as torch's cast does
    (Triton negates as 0 - y on the GPU, which turns -0.0 into +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(x) / spacing + 12582912.0) - 12582912.0) * spacing
    sign = (bits >> 31) << 31  # int32 shifts only: 0x80000000 as a literal would not be int32
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    k_scale,
    v_scale,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = (slots[:, None] >= 0) & (heads[None, :] < num_kv_heads)
    mask = row_mask[:, :, None] & (dims[None, None, :] < HEAD_DIM)
    blocks = tl.maximum(slots, 0) // BLOCK_SIZE
    offsets = tl.maximum(slots, 0) % BLOCK_SIZE
    cache_rows = (
        blocks[:, None] * stride_cache_block
        + heads[None, :] * stride_cache_head
        + offsets[:, None] * stride_cache_token
    )
    cache_offsets = cache_rows[:, :, None] + dims[None, None, :]
    key_rows = tokens[:, None] * stride_key_token + heads[None, :] * stride_key_head
    value_rows = tokens[:, None] * stride_value_token + heads[None, :] * stride_value_head
    key = tl.load(key_ptr + key_rows[:, :, None] + dims[None, None, :], mask=mask)
    value = tl.load(value_ptr + value_rows[:, :, None] + dims[None, None, :], mask=mask)
    if KV_FP8:
        key = _round_to_e4m3(tl.clamp(key.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX))
        value = _round_to_e4m3(tl.clamp(value.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX))
        key = key.to(key_cache_ptr.dtype.element_ty)
        value = value.to(value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [tokens, kv_heads, head_dim] (any token/head strides) -> the caches
    [num_blocks, kv_heads, block_size, head_dim] at `slot_mapping` [tokens] (-1: skip).
    key and value have the cache's dtype, or any compute dtype over an fp8 cache, which stores
    them divided by k_scale / v_scale (ignored for other caches).

    Slots must be distinct and < num_blocks * block_size (the block manager's invariant; not
    checked here, as that would cost a device sync every step).
    """
    check_paged_cache(key_cache, value_cache)
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    check_rows_for_cache("key", key, num_kv_heads, head_dim, key_cache)
    check_rows("value", value, num_kv_heads, head_dim, key)
    check_scales(k_scale, v_scale)
    check_index("slot_mapping", slot_mapping, 1, key_cache.device)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"key has {num_tokens} tokens, value {value.shape[0]}, "
            f"slot_mapping {slot_mapping.shape[0]}; they must agree"
        )
    if num_tokens == 0:
        return
    if not kernel_runs_on(_store_kv_kernel, key_cache.device):
        store_kv_reference(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    _store_kv_kernel[(triton.cdiv(num_tokens, TOKENS_PER_PROGRAM),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TOKENS=TOKENS_PER_PROGRAM,
        KV_FP8=key_cache.dtype in FP8_CACHE_DTYPES,
        FP8_MAX=FP8_E4M3_MAX,
    )
