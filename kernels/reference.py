"""Pure-torch references of every kernel: the definition each kernel is tested against, and the
path the wrappers take where Triton cannot run (CPU tensors without the interpreter).

They favour being obviously right over being fast: attention loops over sequences, gathers each
one's keys by its block table, and computes a masked softmax in fp32.

Shared conventions (see the kernel files for the interfaces):
  caches are [num_blocks, num_kv_heads, block_size, head_dim]; slot = block * block_size + offset;
  query head h reads KV head h // (num_heads // num_kv_heads);
  a query at position p sees keys at positions <= p, and > p - sliding_window when there is one;
  an fp8 cache (float8_e4m3fn) stores fp8(clamp(x / scale, +-fp8 max)) and is read as
  float(stored) * scale, with one key scale and one value scale per call (vLLM's semantics).
"""

from __future__ import annotations

import torch

FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a cache of `cache_dtype` stores for `x`: an fp8 cache x / scale, clamped to its
    range, computed in fp32; any other cache x itself."""
    if cache_dtype not in FP8_CACHE_DTYPES:
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What stored cache elements mean, in fp32."""
    values = stored.float()
    return values * scale if stored.dtype in FP8_CACHE_DTYPES else values


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    block_size = key_cache.shape[2]
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = to_cache(key[written], key_cache.dtype, k_scale)
    value_cache[blocks, :, offsets] = to_cache(value[written], value_cache.dtype, v_scale)


def gather_sequence(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """[num_kv_heads, seq_len, head_dim] keys or values of one sequence, in position order."""
    num_blocks = -(-seq_len // cache.shape[2])
    blocks = cache[torch.tensor(block_table[:num_blocks], dtype=torch.long, device=cache.device)]
    return blocks.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :seq_len]


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query [n, heads, dim] at `query_positions`, keys/values [kv_heads, seq_len, dim] at
    positions 0..seq_len-1 -> [n, heads, dim] in fp32."""
    group = query.shape[1] // keys.shape[0]
    keys = keys.float().repeat_interleave(group, dim=0)
    values = values.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hkd->hnk", query.float(), keys) * scale
    key_positions = torch.arange(keys.shape[1], device=query.device)
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnk,hkd->nhd", weights, values)


def decode_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [num_seqs, heads, dim]: each sequence's last token (position seq_len - 1) -> out."""
    out = torch.empty_like(q) if out is None else out
    tables = block_tables.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[i] = 0
            continue
        keys = from_cache(gather_sequence(key_cache, tables[i], seq_len), k_scale)
        values = from_cache(gather_sequence(value_cache, tables[i], seq_len), v_scale)
        position = torch.tensor([seq_len - 1], device=q.device)
        out[i] = attend(q[i : i + 1], keys, values, position, scale, sliding_window)[0]
    return out


def prefill_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [tokens, heads, dim]; sequence i's queries are rows query_start[i]:query_start[i+1], at
    the last positions of its seq_lens[i] tokens, whose keys are all in the cache -> out."""
    out = torch.empty_like(q) if out is None else out
    tables = block_tables.tolist()
    starts = query_start.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[i], starts[i + 1]
        if begin == end:
            continue
        keys = from_cache(gather_sequence(key_cache, tables[i], seq_len), k_scale)
        values = from_cache(gather_sequence(value_cache, tables[i], seq_len), v_scale)
        positions = torch.arange(seq_len - (end - begin), seq_len, device=q.device)
        out[begin:end] = attend(q[begin:end], keys, values, positions, scale, sliding_window)
    return out


def copy_blocks_reference(buffer: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """buffer [num_layers, 2, num_blocks, ...]: block src[i] -> block dst[i], every layer (any
    dtype: fp8 buffers move as they are)."""
    buffer[:, :, dst.long()] = buffer[:, :, src.long()]

