"""Pure-torch paged attention: the CPU path and the reference for the Triton kernels.

Decode tokens (query length 1) come first in the flat batch and are attended in one batched
call: their blocks are gathered by block table into [B, kv_heads, max_len, dim] and padded
positions are masked. Every other sequence (a prefill chunk) is attended on its own with SDPA:
causal when it has no cached context, else with an explicit mask (full over context, causal
within the chunk). A chunk with no context attends to its fresh keys without touching the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.batch import FlatBatch


@dataclass
class PrefillSpan:
    query_start: int
    query_end: int
    context_len: int
    block_index: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_index: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]


def allowed_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean [queries, keys]: causal, and within the sliding window when there is one."""
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
    return allowed


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, batch: FlatBatch) -> TorchAttentionMetadata:
        device = batch.input_ids.device
        block_size = self.kv_cache.spec.block_size
        num_decodes = 0
        while num_decodes < batch.num_seqs and batch.query_len(num_decodes) == 1:
            num_decodes += 1
        if any(batch.query_len(i) == 1 for i in range(num_decodes, batch.num_seqs)):
            raise ValueError("decode tokens (query length 1) must come first in the flat batch")

        decode_block_index = decode_mask = None
        if num_decodes:
            seq_lens = batch.seq_lens[:num_decodes]
            max_blocks = -(-max(seq_lens) // block_size)
            tables = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks]))
                      for t in batch.block_tables[:num_decodes]]
            decode_block_index = torch.tensor(tables, dtype=torch.long, device=device)
            key_positions = torch.arange(max_blocks * block_size, device=device)
            lens = torch.tensor(seq_lens, device=device)
            decode_mask = key_positions[None, :] < lens[:, None]
            if self.sliding_window is not None:
                decode_mask &= key_positions[None, :] > lens[:, None] - 1 - self.sliding_window
            decode_mask = decode_mask[:, None, None, :]

        prefills = []
        for i in range(num_decodes, batch.num_seqs):
            context_len, seq_len = batch.context_lens[i], batch.seq_lens[i]
            num_blocks = -(-seq_len // block_size)
            mask = None
            if context_len > 0 or self.sliding_window is not None:
                query_positions = torch.arange(context_len, seq_len, device=device)
                key_positions = torch.arange(seq_len, device=device)
                mask = allowed_keys(query_positions, key_positions, self.sliding_window)
            prefills.append(
                PrefillSpan(
                    query_start=batch.query_start[i],
                    query_end=batch.query_start[i + 1],
                    context_len=context_len,
                    block_index=torch.tensor(
                        batch.block_tables[i][:num_blocks], dtype=torch.long, device=device
                    ),
                    mask=mask,
                )
            )
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_decodes=num_decodes,
            decode_block_index=decode_block_index,
            decode_mask=decode_mask,
            prefills=prefills,
        )

    def forward(self, layer, q, k, v, metadata: TorchAttentionMetadata) -> torch.Tensor:
        key_cache = self.kv_cache.key_cache(layer)
        value_cache = self.kv_cache.value_cache(layer)
        heads, dim = self.num_kv_heads, self.head_dim
        key_cache.view(-1, heads, dim).index_copy_(0, metadata.slot_mapping, k)
        value_cache.view(-1, heads, dim).index_copy_(0, metadata.slot_mapping, v)

        out = torch.empty_like(q)
        num_decodes = metadata.num_decodes
        if num_decodes:
            out[:num_decodes] = self._decode(
                q[:num_decodes], key_cache, value_cache, metadata
            )
        for span in metadata.prefills:
            out[span.query_start:span.query_end] = self._prefill(
                q, k, v, key_cache, value_cache, span
            )
        return out

    def _decode(self, q, key_cache, value_cache, metadata) -> torch.Tensor:
        batch_size = q.shape[0]
        block_index = metadata.decode_block_index
        keys = key_cache[block_index].view(batch_size, -1, self.num_kv_heads, self.head_dim)
        values = value_cache[block_index].view(batch_size, -1, self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=metadata.decode_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(2)

    def _prefill(self, q, k, v, key_cache, value_cache, span: PrefillSpan) -> torch.Tensor:
        query = q[span.query_start:span.query_end].transpose(0, 1).unsqueeze(0)
        if span.context_len == 0:
            keys = k[span.query_start:span.query_end]
            values = v[span.query_start:span.query_end]
        else:
            seq_len = span.context_len + span.query_end - span.query_start
            keys = key_cache[span.block_index].view(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            values = value_cache[span.block_index].view(-1, self.num_kv_heads, self.head_dim)
            values = values[:seq_len]
        out = F.scaled_dot_product_attention(
            query,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)
