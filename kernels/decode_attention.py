"""Paged decode attention: one query token per sequence over the keys its block table names.

Tiling (split-KV, "flash-decoding"):
  grid (num_seqs, num_kv_heads, num_splits). A program holds the query heads that share one KV
  head ([group, head_dim], padded to 16 rows so the products run on tensor cores), so each key
  and value is read from memory once per group, not once per query head. It walks its split's
  keys `tile` positions at a time - a tile may span several blocks: every position looks its
  block up in the table - with an online softmax in fp32.
  With one split the program writes the normalized output. With several, each writes its
  normalized partial output and its log-sum-exp, and a second kernel (grid num_seqs x
  num_heads) combines the splits, weighting each by exp(lse - max lse).
The plan's tile is an upper bound: the kernel walks keys by the largest tile of kernels/tiles.py
that fits the device's shared memory and divides the plan's (every power of two below it does).
Splits cover [kv_start, seq_len), where kv_start = max(0, seq_len - sliding_window) when there
is a window, so a windowed sequence reads only the keys it can see. A sequence of length 0
(padding) gets zeros; so does a split that lies past its sequence's end, with weight 0.
An fp8 cache's keys and values are read as float(x) * k_scale / v_scale, rounded to the
query's dtype, before they enter the products (kernels/reference.py's `from_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import (
    FP8_CACHE_DTYPES,
    LOG2_E,
    MIN_DOT_DIM,
    NO_WINDOW,
    ceil_div,
    check_index,
    check_paged_cache,
    check_rows,
    check_rows_for_cache,
    check_scales,
    dot_dim,
    dot_operands,
    kernel_runs_on,
    next_power_of_2,
)
from pdserve.kernels.reference import decode_attention_reference
from pdserve.kernels.tiles import (
    DecodeTiles,
    decode_candidates,
    device_shared_memory,
    launch_with_fallback,
)

MIN_GROUP_ROWS = MIN_DOT_DIM


@dataclass(frozen=True)
class SplitPlan:
    """How the keys of each sequence divide among programs: `num_splits` splits of
    `tokens_per_split` keys (a multiple of `tile`), each read `tile` keys at a time.

    Invariant: num_splits * tokens_per_split >= every sequence's key span (its length, or the
    window when shorter); keys past the last split would be left out, unchecked on the device.
    """

    num_splits: int
    tokens_per_split: int
    tile: int

    def __post_init__(self) -> None:
        if self.num_splits < 1 or self.tile < 16 or self.tile & (self.tile - 1):
            raise ValueError(f"need num_splits >= 1 and a power-of-two tile >= 16: {self}")
        if self.tokens_per_split < self.tile or self.tokens_per_split % self.tile:
            raise ValueError(f"tokens_per_split must be a positive multiple of tile: {self}")


def plan_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_processors: int,
    tile: int = 64,
    min_tokens_per_split: int = 256,
) -> SplitPlan:
    """Enough splits to give `num_processors` (GPU SMs) about two programs each, but none
    shorter than `min_tokens_per_split` keys, so the combine step stays cheap."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = ceil_div(2 * num_processors, programs)
    useful = max(1, ceil_div(max_seq_len, min_tokens_per_split))
    num_splits = max(1, min(wanted, useful))
    longest = max(max_seq_len, 1)
    tokens_per_split = ceil_div(ceil_div(longest, num_splits), tile) * tile
    return SplitPlan(ceil_div(longest, tokens_per_split), tokens_per_split, tile)


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    k_scale,
    v_scale,
    sliding_window,
    tokens_per_split,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_head,
    stride_cache_token,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    kv_start = tl.maximum(seq_len - sliding_window, 0)
    split_start = kv_start + split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_mask = (rows[:, None] < GROUP) & dim_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    ).to(DOT_DTYPE)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_cache_head
    for tile_start in range(split_start, split_end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < split_end
        block_ids = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = (
            block_ids[:, None] * stride_cache_block
            + head_offset
            + (positions % BLOCK_SIZE)[:, None] * stride_cache_token
            + dims[None, :]
        )
        kv_mask = valid[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if KV_FP8:
            keys = (keys.to(tl.float32) * k_scale).to(q_ptr.dtype.element_ty)
        scores = tl.dot(q, tl.trans(keys.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        scores = scores * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
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

    # An empty split (past its sequence's end, or length 0) has sum 0: output 0, lse -inf.
    has_keys = running_sum > 0
    safe_sum = tl.where(has_keys, running_sum, 1.0)
    result = acc / safe_sum[:, None]
    if WRITE_PARTIAL:
        lse = tl.where(has_keys, running_max + tl.log2(safe_sum), float("-inf"))
        partial_rows = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(partial_lse_ptr + partial_rows, lse, mask=rows < GROUP)
        tl.store(
            partial_out_ptr + partial_rows[:, None] * HEAD_DIM + dims[None, :], result, mask=q_mask
        )
    else:
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    partial_rows = (seq * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(partial_lse_ptr + partial_rows, mask=split_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, 0)
    total = tl.where(total > 0, total, 1.0)
    parts = tl.load(
        partial_out_ptr + partial_rows[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    result = tl.sum(parts * weights[:, None], 0) / total
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    plan: SplitPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each sequence's last token over its cached keys.

    q [num_seqs, num_heads, head_dim] (the token at position seq_len - 1, whose own key is
    already in the cache); caches [num_blocks, num_kv_heads, block_size, head_dim];
    block_tables [num_seqs, max_blocks] int32 with at least ceil(seq_len / block_size) valid
    entries per row; seq_lens [num_seqs] int32 (0: padding, output zeros).
    Returns `out` [num_seqs, num_heads, head_dim] (allocated when None).
    plan None: derived from seq_lens' maximum, which costs a device sync.
    An fp8 cache (q in a compute dtype) is read as float(x) * k_scale / v_scale; other caches
    ignore the scales.
    """
    check_paged_cache(key_cache, value_cache)
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    num_seqs, num_heads, _ = q.shape
    check_rows_for_cache("q", q, num_heads, head_dim, key_cache)
    check_scales(k_scale, v_scale)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    out = torch.empty_like(q) if out is None else out
    check_rows("out", out, num_heads, head_dim, q)
    check_index("block_tables", block_tables, 2, q.device)
    check_index("seq_lens", seq_lens, 1, q.device)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs or out.shape[0] != num_seqs:
        raise ValueError(
            f"q has {num_seqs} sequences; block_tables {block_tables.shape[0]}, seq_lens "
            f"{seq_lens.shape[0]}, out {out.shape[0]}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if num_seqs == 0:
        return out
    if not kernel_runs_on(_decode_attention_kernel, q.device):
        return decode_attention_reference(
            q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, out,
            k_scale, v_scale,
        )
    if plan is None:
        processors = (
            torch.cuda.get_device_properties(q.device).multi_processor_count
            if q.device.type == "cuda" else 1
        )
        plan = plan_splits(num_seqs, num_kv_heads, int(seq_lens.max()), processors)

    group = num_heads // num_kv_heads
    group_rows = max(MIN_GROUP_ROWS, next_power_of_2(group))
    dot_dtype, precision = dot_operands(q.dtype, _decode_attention_kernel)
    write_partial = plan.num_splits > 1
    if write_partial:
        partial_out = torch.empty(
            num_seqs, num_heads, plan.num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            num_seqs, num_heads, plan.num_splits, dtype=torch.float32, device=q.device
        )
    else:
        partial_out = partial_lse = out

    def launch(tiles: DecodeTiles) -> None:
        _decode_attention_kernel[(num_seqs, num_kv_heads, plan.num_splits)](
            q,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            out,
            partial_out,
            partial_lse,
            scale * LOG2_E,
            k_scale,
            v_scale,
            sliding_window or NO_WINDOW,
            plan.tokens_per_split,
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            plan.num_splits,
            GROUP=group,
            GROUP_PAD=group_rows,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=dot_dim(head_dim),
            BLOCK_SIZE=block_size,
            TILE=tiles.tile,
            WRITE_PARTIAL=write_partial,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=precision,
            KV_FP8=key_cache.dtype in FP8_CACHE_DTYPES,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )

    fitting = decode_candidates(q.dtype, head_dim, device_shared_memory(q.device), group_rows)
    candidates = list(
        dict.fromkeys(DecodeTiles(min(t.tile, plan.tile), t.num_stages) for t in fitting)
    )
    launch_with_fallback(
        (q.device, "decode", q.dtype, head_dim, group_rows, plan.tile), candidates, launch
    )
    if write_partial:
        _combine_splits_kernel[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            out,
            out.stride(0),
            out.stride(1),
            plan.num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=next_power_of_2(head_dim),
            SPLITS_PAD=next_power_of_2(plan.num_splits),
        )
    return out
