"""Attention backend interface.

The model runner calls `prepare(batch)` once per step (building whatever index tensors the
backend needs, shared by all layers), then every layer calls `forward(layer, q, k, v, metadata)`,
which stores the step's keys and values into the paged cache at `batch.slot_mapping` (an fp8
cache: divided by the layer's scale in `kv_scales`, engine/kv/kv_scales.py) and returns
attention outputs for every token of the flat batch: full attention over each sequence's cached
context, causal within its new tokens, grouped-query heads sharing their KV head.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.engine.batch import FlatBatch
from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.kv.kv_scales import KVScales


def count_leading_decodes(batch: FlatBatch) -> int:
    """How many sequences at the start of the batch decode (query length 1); the model runner
    puts every decode first, and a decode after a prefill chunk is an error."""
    num_decodes = 0
    while num_decodes < batch.num_seqs and batch.query_len(num_decodes) == 1:
        num_decodes += 1
    if any(batch.query_len(i) == 1 for i in range(num_decodes, batch.num_seqs)):
        raise ValueError("decode tokens (query length 1) must come first in the flat batch")
    return num_decodes


class AttentionBackend(ABC):
    def __init__(
        self,
        kv_cache: KVCache,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        kv_scales: KVScales | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        num_layers = kv_cache.spec.num_layers
        self.kv_scales = kv_scales or KVScales.ones(num_layers)
        if len(self.kv_scales.k) != num_layers:
            raise ValueError(
                f"{len(self.kv_scales.k)} KV scales for a cache of {num_layers} layers"
            )

    @abstractmethod
    def prepare(self, batch: FlatBatch) -> object:
        """Per-step metadata derived from the batch; called once before the layers run."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] -> out [T, heads, dim]; writes k/v to cache."""
