"""Triton paged attention: the GPU path.

Each layer first writes the step's keys and values into the cache (`store_kv`), so both
attention kernels read every key from the paged cache alone (an fp8 cache: stored divided by
the layer's scales, read multiplied by them, inside the kernels). Decode tokens (query length 1,
first in the flat batch) go to split-KV decode attention; the prefill chunks after them go to
varlen prefill/extend attention (full over the cached prefix, causal within the chunk).

`prepare` builds one set of int32 index tensors per step - block tables cut to the blocks each
sequence uses, sequence lengths, query offsets - shared by every layer, and chooses the decode
split plan from the device's processor count.

On CUDA the kernels are compiled. On the CPU they run in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (the tests do this), and otherwise the
kernels' pure-torch references run: correct everywhere, fast only on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import AttentionBackend, count_leading_decodes
from pdserve.engine.batch import FlatBatch
from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.kv.kv_scales import KVScales, is_fp8
from pdserve.kernels.decode_attention import SplitPlan, decode_attention, plan_splits
from pdserve.kernels.prefill_attention import prefill_attention
from pdserve.kernels.store_kv import store_kv


@dataclass
class DecodeMetadata:
    """The first `num_seqs` sequences of the batch, one query token each."""

    num_seqs: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    plan: SplitPlan


@dataclass
class PrefillMetadata:
    """The remaining sequences; `query_start` holds absolute row offsets into the flat batch."""

    block_tables: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


class TritonAttentionBackend(AttentionBackend):
    def __init__(
        self,
        kv_cache: KVCache,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        kv_scales: KVScales | None = None,
    ) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, sliding_window, kv_scales)
        device = kv_cache.buffer.device
        self.num_processors = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 1
        )
        if is_fp8(kv_cache.spec.dtype) and device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 9):
                raise ValueError(
                    f"an fp8 KV cache needs a GPU of compute capability 8.9 or newer (Triton's "
                    f"fp8e4nv); {device} is {capability[0]}.{capability[1]}: use "
                    "kv_cache_dtype 'auto'"
                )

    def prepare(self, batch: FlatBatch) -> TritonAttentionMetadata:
        device = batch.input_ids.device
        block_size = self.kv_cache.spec.block_size
        num_decodes = count_leading_decodes(batch)

        used_blocks = [-(-n // block_size) for n in batch.seq_lens]
        width = max(used_blocks, default=0) or 1
        tables = [
            table[:count] + [0] * (width - count)
            for table, count in zip(batch.block_tables, used_blocks)
        ]
        block_tables = torch.tensor(tables, dtype=torch.int32, device=device).view(-1, width)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=device)

        decode = None
        if num_decodes:
            decode = self.decode_metadata(
                block_tables[:num_decodes],
                seq_lens[:num_decodes],
                max(batch.seq_lens[:num_decodes]),
            )
        prefill = None
        if num_decodes < batch.num_seqs:
            prefill = PrefillMetadata(
                block_tables=block_tables[num_decodes:],
                query_start=torch.tensor(
                    batch.query_start[num_decodes:], dtype=torch.int32, device=device
                ),
                seq_lens=seq_lens[num_decodes:],
                max_query_len=max(
                    batch.query_len(i) for i in range(num_decodes, batch.num_seqs)
                ),
            )
        return TritonAttentionMetadata(batch.slot_mapping, decode, prefill)

    def decode_metadata(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int
    ) -> DecodeMetadata:
        """Decode metadata over the given tensors. The split plan depends only on the number
        of sequences and `max_seq_len` (an upper bound), so metadata built once over fixed
        buffers serves every step of that batch size (CUDA graphs)."""
        longest_span = min(max_seq_len, self.sliding_window or max_seq_len)
        plan = plan_splits(
            block_tables.shape[0], self.num_kv_heads, longest_span, self.num_processors
        )
        return DecodeMetadata(block_tables.shape[0], block_tables, seq_lens, plan)

    def forward(self, layer, q, k, v, metadata: TritonAttentionMetadata) -> torch.Tensor:
        key_cache = self.kv_cache.key_cache(layer)
        value_cache = self.kv_cache.value_cache(layer)
        k_scale, v_scale = self.kv_scales.k[layer], self.kv_scales.v[layer]
        store_kv(k, v, key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        decode = metadata.decode
        if decode is not None:
            decode_attention(
                q[: decode.num_seqs],
                key_cache,
                value_cache,
                decode.block_tables,
                decode.seq_lens,
                self.scale,
                self.sliding_window,
                out=out[: decode.num_seqs],
                plan=decode.plan,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        prefill = metadata.prefill
        if prefill is not None:
            prefill_attention(
                q,
                key_cache,
                value_cache,
                prefill.block_tables,
                prefill.query_start,
                prefill.seq_lens,
                prefill.max_query_len,
                self.scale,
                self.sliding_window,
                out=out,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out
