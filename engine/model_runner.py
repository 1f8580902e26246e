"""Runs one scheduled step on the device: flat batch -> model forward -> sampled tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.attention import attention_backend_class
from engine.batch import build_flat_batch
from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from engine.cpu_allocator import keep_freed_memory_for_reuse
from engine.kv_cache import KVCache, KVCacheSpec
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.sampler import Sampler, SampleResult
from engine.scheduler import ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)


KVCacheFactory = Callable[[KVCacheSpec, int, torch.device], KVCache]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        kv_cache_factory: KVCacheFactory = KVCache,
    ):
        self.config = config
        self.model_config = model_config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device, model_config.config_dtype)
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
        self.model = load_model(model_config, max_model_len, self.dtype, self.device)
        spec = KVCacheSpec(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
        )
        num_blocks = config.num_kv_blocks or spec.num_blocks_for(self._kv_cache_budget())
        self.kv_cache = kv_cache_factory(spec, num_blocks, self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.kv_cache.num_blocks, config.block_size,
            self.kv_cache.num_blocks * spec.bytes_per_block / 2**20,
        )
        self.attention = attention_backend_class(config.attention_backend)(
            self.kv_cache,
            model_config.num_heads,
            model_config.num_kv_heads,
            model_config.head_dim,
            model_config.sliding_window,
        )
        self.sampler = Sampler(config.seed, self.device)
        self.decode_graphs = None
        if config.cuda_graphs and self.device.type == "cuda":
            from engine.cuda_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                self.model, self.attention, config.max_num_seqs, max_model_len,
                config.block_size, self.device,
            )

    def _kv_cache_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_MEMORY
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * self.config.gpu_memory_utilization) - (total - free)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> list[tuple[ScheduledSequence, SampleResult]]:
        """Runs the step; returns a sample for each sequence whose chunk reached its end."""
        self.kv_cache.copy_blocks(step.blocks_to_copy)
        ordered = sorted(step.scheduled, key=lambda s: s.num_new_tokens != 1)
        batch = build_flat_batch(
            token_chunks=[
                s.seq.token_ids[s.seq.num_computed_tokens:s.seq.num_computed_tokens + s.num_new_tokens]
                for s in ordered
            ],
            context_lens=[s.seq.num_computed_tokens for s in ordered],
            block_tables=[s.seq.block_table for s in ordered],
            sample_flags=[s.completes_prompt for s in ordered],
            block_size=self.config.block_size,
            device=self.device,
        )
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            logits = self.decode_graphs.run(batch)
        else:
            metadata = self.attention.prepare(batch)
            logits = self.model(
                batch.input_ids, batch.positions, batch.logits_indices, self.attention, metadata
            )
        sampled = [s for s in ordered if s.completes_prompt]
        if not sampled:
            return []
        results = self.sampler(logits, [s.seq for s in sampled])
        return list(zip(sampled, results))
