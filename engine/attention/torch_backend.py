"""Pure-torch paged attention: the CPU path and the reference for the Triton kernels.

Keys and values are stored by slot into head-major blocks ([blocks, kv_heads, block_size, dim]).

Decode tokens (query length 1) come first in the flat batch. On the CPU they are attended by
the compiled kernel of engine/attention/cpu_decode.py, which reads each block in place. Where
it cannot run (not a CPU, numba missing, an fp16 cache), they are attended together, block
by block, with no padding: every block of every decoding sequence is gathered once (whole
blocks, by `index_select`, the fast copy), each block is scored against its sequence's query
heads - the query heads sharing a KV head form one small matrix, so each key is read once - and
a softmax segmented by sequence (per-sequence max, then sums by `index_add_`) combines them. Every other sequence (a prefill chunk) is attended on its own with
SDPA: causal when it has no cached context (using its fresh keys, without touching the cache),
else with an explicit mask (full over the context, causal within the chunk).

An fp8 cache (engine/kv/kv_scales.py) stores the step's keys and values divided by the layer's
scales, as bytes (torch has no fp8 index_copy_ on the CPU), and every read multiplies them back.
A chunk without context then attends its fresh keys after that same round trip - what the cache
holds - so a prompt's attention does not depend on how it was chunked, on which node, or
whether its prefix came from the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import AttentionBackend, count_leading_decodes
from pdserve.engine.attention.cpu_decode import CpuDecodeKernel, PagedDecode
from pdserve.engine.batch import FlatBatch
from pdserve.engine.kv.kv_scales import dequantize, is_fp8, quantize


@dataclass
class DecodeBlocks:
    """Every block of the decoding sequences, flattened; `seq_index` says whose it is."""

    num_seqs: int
    block_ids: torch.Tensor
    seq_index: torch.Tensor
    bias: torch.Tensor


@dataclass
class PrefillSpan:
    query_start: int
    query_end: int
    context_len: int
    block_index: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    cache_rows: torch.Tensor  # [tokens * kv_heads]: each (token, KV head)'s row in a layer's cache
    num_decodes: int
    decode: DecodeBlocks | PagedDecode | None
    prefills: list[PrefillSpan]


def allowed_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Which keys each query may attend (broadcasting the two position tensors): causal, and
    within the sliding window when there is one."""
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    return allowed


class TorchAttentionBackend(AttentionBackend):
    def __init__(
        self, kv_cache, num_heads, num_kv_heads, head_dim, sliding_window, kv_scales=None
    ) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, sliding_window, kv_scales)
        self.cache_dtype = kv_cache.spec.dtype
        self.fp8 = is_fp8(self.cache_dtype)
        # The compiled in-place decode on the CPU; None: the gather path (`_decode`).
        self.cpu_decode = CpuDecodeKernel.for_cache(
            kv_cache, num_heads, self.scale, sliding_window, self.kv_scales
        )

    def prepare(self, batch: FlatBatch) -> TorchAttentionMetadata:
        device = batch.input_ids.device
        block_size = self.kv_cache.spec.block_size
        num_decodes = count_leading_decodes(batch)
        block_counts = [-(-n // block_size) for n in batch.seq_lens]
        decode = None
        if num_decodes and self.cpu_decode is not None:
            decode = self.cpu_decode.prepare(batch, num_decodes)
        elif num_decodes:
            decode = self._decode_blocks(batch, num_decodes, block_counts)

        prefills = []
        for i in range(num_decodes, batch.num_seqs):
            context_len, seq_len = batch.context_lens[i], batch.seq_lens[i]
            mask = None
            if context_len > 0 or self.sliding_window is not None:
                query_positions = torch.arange(context_len, seq_len, device=device)
                key_positions = torch.arange(seq_len, device=device)
                mask = allowed_keys(
                    query_positions[:, None], key_positions[None, :], self.sliding_window
                )
            prefills.append(
                PrefillSpan(
                    query_start=batch.query_start[i],
                    query_end=batch.query_start[i + 1],
                    context_len=context_len,
                    block_index=torch.tensor(
                        batch.block_tables[i][: block_counts[i]], dtype=torch.long, device=device
                    ),
                    mask=mask,
                )
            )
        return TorchAttentionMetadata(
            cache_rows=self._cache_rows(batch.slot_mapping),
            num_decodes=num_decodes,
            decode=decode,
            prefills=prefills,
        )

    def _cache_rows(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's key (or value) cache viewed as [blocks * kv_heads * block_size,
        head_dim] where each token's key (value) heads go: one `index_copy_` stores a layer."""
        block_size = self.kv_cache.spec.block_size
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        heads = torch.arange(self.num_kv_heads, device=slot_mapping.device)
        first_rows = blocks * (self.num_kv_heads * block_size) + slot_mapping % block_size
        return (first_rows[:, None] + heads * block_size).flatten()

    def _decode_blocks(
        self, batch: FlatBatch, num_decodes: int, block_counts: list[int]
    ) -> DecodeBlocks:
        device = batch.input_ids.device
        block_size = self.kv_cache.spec.block_size
        block_ids, seq_index, key_positions, query_positions = [], [], [], []
        for i in range(num_decodes):
            count = block_counts[i]
            block_ids.extend(batch.block_tables[i][:count])
            seq_index.extend([i] * count)
            key_positions.extend(range(0, count * block_size, block_size))
            query_positions.extend([batch.seq_lens[i] - 1] * count)
        offsets = torch.arange(block_size, device=device)
        keys = torch.tensor(key_positions, device=device)[:, None] + offsets
        queries = torch.tensor(query_positions, device=device)[:, None]
        allowed = allowed_keys(queries, keys, self.sliding_window)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
        bias.masked_fill_(~allowed, float("-inf"))
        return DecodeBlocks(
            num_seqs=num_decodes,
            block_ids=torch.tensor(block_ids, dtype=torch.long, device=device),
            seq_index=torch.tensor(seq_index, dtype=torch.long, device=device),
            bias=bias[:, None, None, :],
        )

    def forward(self, layer, q, k, v, metadata: TorchAttentionMetadata) -> torch.Tensor:
        key_cache = self.kv_cache.key_cache(layer)
        value_cache = self.kv_cache.value_cache(layer)
        k_scale, v_scale = self.kv_scales.k[layer], self.kv_scales.v[layer]
        rows, dim = metadata.cache_rows, self.head_dim
        if self.fp8:
            # torch has no index_copy_ for fp8 on the CPU: store the bytes.
            stored_k = quantize(k.reshape(-1, dim), self.cache_dtype, k_scale)
            stored_v = quantize(v.reshape(-1, dim), self.cache_dtype, v_scale)
            key_cache.view(torch.uint8).view(-1, dim).index_copy_(
                0, rows, stored_k.view(torch.uint8)
            )
            value_cache.view(torch.uint8).view(-1, dim).index_copy_(
                0, rows, stored_v.view(torch.uint8)
            )
            if metadata.prefills:  # a chunk without context attends what the cache holds
                k = dequantize(stored_k, q.dtype, k_scale).view_as(k)
                v = dequantize(stored_v, q.dtype, v_scale).view_as(v)
        else:
            key_cache.view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim))
            value_cache.view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim))

        out = torch.empty_like(q)
        decode = metadata.decode
        if isinstance(decode, PagedDecode):
            n = decode.num_seqs
            self.cpu_decode.attend(layer, q[:n], key_cache, value_cache, decode, out[:n])
        elif decode is not None:
            out[: decode.num_seqs] = self._decode(
                q[: decode.num_seqs], key_cache, value_cache, decode, k_scale, v_scale
            )
        for span in metadata.prefills:
            out[span.query_start:span.query_end] = self._prefill(
                q, k, v, key_cache, value_cache, span, k_scale, v_scale
            )
        return out

    def _decode(
        self, q, key_cache, value_cache, decode: DecodeBlocks, k_scale=1.0, v_scale=1.0
    ) -> torch.Tensor:
        num_seqs, heads, dim = decode.num_seqs, self.num_kv_heads, self.head_dim
        # In fp32 whatever the cache holds, rounded where SDPA's CPU kernel rounds 16-bit
        # attention (the scale after q.k, the softmax weights to q's dtype before they weight
        # the values): in bf16 that keeps greedy tokens on transformers' up to near-ties.
        keys = dequantize(key_cache.index_select(0, decode.block_ids), torch.float32, k_scale)
        values = dequantize(
            value_cache.index_select(0, decode.block_ids), torch.float32, v_scale
        )
        grouped_q = q.float().view(num_seqs, heads, -1, dim)
        block_q = grouped_q.index_select(0, decode.seq_index)
        scores = torch.matmul(block_q, keys.transpose(-1, -2)).mul_(self.scale) + decode.bias
        block_max = scores.amax(dim=-1)
        seq_max = torch.full_like(grouped_q[..., 0], float("-inf")).scatter_reduce_(
            0, decode.seq_index[:, None, None].expand_as(block_max), block_max, "amax"
        )
        weights = torch.exp(scores - seq_max.index_select(0, decode.seq_index).unsqueeze(-1))
        denominator = torch.zeros_like(seq_max).index_add_(0, decode.seq_index, weights.sum(-1))
        out = torch.zeros_like(grouped_q).index_add_(
            0, decode.seq_index, torch.matmul(weights.to(q.dtype).float(), values)
        )
        out = out / denominator.unsqueeze(-1)
        return out.to(q.dtype).view(num_seqs, self.num_heads, dim)

    def _prefill(
        self, q, k, v, key_cache, value_cache, span: PrefillSpan, k_scale=1.0, v_scale=1.0
    ) -> torch.Tensor:
        query = q[span.query_start:span.query_end].transpose(0, 1).unsqueeze(0)
        if span.context_len == 0:
            keys = k[span.query_start:span.query_end].transpose(0, 1)
            values = v[span.query_start:span.query_end].transpose(0, 1)
        else:
            seq_len = span.context_len + span.query_end - span.query_start
            keys = self._gather_sequence(key_cache, span.block_index, seq_len)
            values = self._gather_sequence(value_cache, span.block_index, seq_len)
            if self.fp8:
                keys = dequantize(keys, q.dtype, k_scale)
                values = dequantize(values, q.dtype, v_scale)
        out = F.scaled_dot_product_attention(
            query,
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)

    def _gather_sequence(self, cache, block_index, seq_len) -> torch.Tensor:
        """[kv_heads, seq_len, dim] keys or values of one sequence."""
        blocks = cache.transpose(0, 1)[:, block_index]
        return blocks.view(self.num_kv_heads, -1, self.head_dim)[:, :seq_len]
