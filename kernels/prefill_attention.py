"""Prefill / extend attention over the paged cache, varlen over the flat batch.

Sequence i's new tokens are rows query_start[i]:query_start[i+1] of q, at positions
context_len .. seq_len-1 (context_len = seq_len - query_len). Their keys and values must
already be in the cache (store_kv runs first), so every key - cached prefix and the chunk
itself - is read from the cache through the block table, and one mask serves both: a query at
position p sees keys at positions <= p, and > p - sliding_window when there is one.

Tiling: grid (num_seqs, ceil(max_query_len / BLOCK_M), num_heads). A program takes BLOCK_M
query rows of one sequence and one head and walks the keys BLOCK_N at a time, from the first
key its earliest row can see (0, or the window's start) to the end of its last row's prefix,
with an online softmax in fp32. A tile may span several cache blocks: each key position looks
its block up in the table. Programs past their sequence's query length write nothing.
BLOCK_M, BLOCK_N and the pipeline depth come from kernels/tiles.py: the largest that fit the
device's shared memory for this dtype and head dim, unless the caller names the tile sizes.
An fp8 cache's keys and values are read as float(x) * k_scale / v_scale, rounded to the
query's dtype (kernels/reference.py's `from_cache`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import (
    FP8_CACHE_DTYPES,
    LOG2_E,
    NO_WINDOW,
    check_index,
    check_paged_cache,
    check_rows,
    check_rows_for_cache,
    check_scales,
    dot_dim,
    dot_operands,
    kernel_runs_on,
)
from pdserve.kernels.reference import prefill_attention_reference
from pdserve.kernels.tiles import (
    PrefillTiles,
    device_shared_memory,
    launch_with_fallback,
    prefill_candidates,
)


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    k_scale,
    v_scale,
    sliding_window,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    tile_start = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    query_begin = tl.load(query_start_ptr + seq).to(tl.int64)
    query_len = (tl.load(query_start_ptr + seq + 1) - query_begin).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - query_len

    rows = tile_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    row_mask = rows < query_len
    q_positions = context_len + rows
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + (query_begin + rows)[:, None] * stride_q_token + head * stride_q_head
        + dims[None, :],
        mask=q_mask,
        other=0.0,
    ).to(DOT_DTYPE)

    first_position = context_len + tile_start
    keys_end = tl.minimum(first_position + BLOCK_M, seq_len)
    keys_begin = tl.maximum(first_position - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    keys_end = tl.where(tile_start < query_len, keys_end, keys_begin)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    head_offset = (head // GROUP) * stride_cache_head
    for key_start in range(keys_begin, keys_end, BLOCK_N):
        key_positions = key_start + tl.arange(0, BLOCK_N)
        in_range = key_positions < keys_end
        block_ids = tl.load(
            table + key_positions // BLOCK_SIZE, mask=in_range, other=0
        ).to(tl.int64)
        offsets = (
            block_ids[:, None] * stride_cache_block
            + head_offset
            + (key_positions % BLOCK_SIZE)[:, None] * stride_cache_token
            + dims[None, :]
        )
        kv_mask = in_range[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if KV_FP8:
            keys = (keys.to(tl.float32) * k_scale).to(q_ptr.dtype.element_ty)
        scores = tl.dot(q, tl.trans(keys.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        scores = scores * scale_log2
        visible = (
            in_range[None, :]
            & (key_positions[None, :] <= q_positions[:, None])
            & (key_positions[None, :] > q_positions[:, None] - sliding_window)
        )
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # A row may see no key of this tile yet (its window starts later, or it is padding):
        # subtract 0 instead of -inf so its weights stay 0 rather than NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(running_max - shift)
        weights = tl.exp2(scores - shift[:, None])
        running_sum = running_sum * correction + tl.sum(weights, 1)
        values = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if KV_FP8:
            values = (values.to(tl.float32) * v_scale).to(q_ptr.dtype.element_ty)
        acc = acc * correction[:, None] + tl.dot(
            weights.to(values.dtype).to(DOT_DTYPE),
            values.to(DOT_DTYPE),
            input_precision=DOT_PRECISION,
        )
        running_max = new_max

    result = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + (query_begin + rows)[:, None] * stride_out_token + head * stride_out_head
        + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of every new token of every sequence over its cached prefix and its own chunk.

    q [tokens, num_heads, head_dim]; caches [num_blocks, num_kv_heads, block_size, head_dim]
    already holding every key of every sequence (the chunk's too); block_tables
    [num_seqs, max_blocks] int32; query_start [num_seqs + 1] int32 (row offsets into q, which
    may start past 0: rows outside the spans are not touched); seq_lens [num_seqs] int32 (prefix
    plus chunk); max_query_len >= every query_start[i+1] - query_start[i] (host-side, sizes the
    grid). Returns `out` [tokens, num_heads, head_dim] (allocated when None).
    block_m / block_n: tile sizes (powers of two >= 16); None picks the largest that fit the
    device (kernels/tiles.py), stepping down if Triton refuses them.
    An fp8 cache (q in a compute dtype) is read as float(x) * k_scale / v_scale; other caches
    ignore the scales.
    """
    check_paged_cache(key_cache, value_cache)
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_heads = q.shape[1]
    check_rows_for_cache("q", q, num_heads, head_dim, key_cache)
    check_scales(k_scale, v_scale)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    out = torch.empty_like(q) if out is None else out
    check_rows("out", out, num_heads, head_dim, q)
    if out.shape[0] != q.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, q has {q.shape[0]}")
    check_index("block_tables", block_tables, 2, q.device)
    check_index("query_start", query_start, 1, q.device)
    check_index("seq_lens", seq_lens, 1, q.device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start.shape[0] != num_seqs + 1:
        raise ValueError(
            f"seq_lens has {num_seqs} sequences; block_tables {block_tables.shape[0]}, "
            f"query_start {query_start.shape[0]} (needs num_seqs + 1)"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size is not None and (size < 16 or size & (size - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if num_seqs == 0 or max_query_len < 1:
        return out
    if not kernel_runs_on(_prefill_attention_kernel, q.device):
        return prefill_attention_reference(
            q, key_cache, value_cache, block_tables, query_start, seq_lens, scale,
            sliding_window, out, k_scale, v_scale,
        )
    dot_dtype, precision = dot_operands(q.dtype, _prefill_attention_kernel)

    def launch(tiles: PrefillTiles) -> None:
        grid = (num_seqs, triton.cdiv(max_query_len, tiles.block_m), num_heads)
        _prefill_attention_kernel[grid](
            q,
            key_cache,
            value_cache,
            block_tables,
            query_start,
            seq_lens,
            out,
            scale * LOG2_E,
            k_scale,
            v_scale,
            sliding_window or NO_WINDOW,
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=dot_dim(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=precision,
            KV_FP8=key_cache.dtype in FP8_CACHE_DTYPES,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )

    candidates = prefill_candidates(q.dtype, head_dim, device_shared_memory(q.device))
    if block_m is None and block_n is None:
        launch_with_fallback((q.device, "prefill", q.dtype, head_dim), candidates, launch)
    else:
        largest = candidates[0]
        launch(
            PrefillTiles(block_m or largest.block_m, block_n or largest.block_n, largest.num_stages)
        )
    return out
