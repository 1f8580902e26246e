"""Runs one scheduled step on the device: flat batch -> model forward -> sampled tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention import attention_backend_class
from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.batch import build_flat_batch
from pdserve.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pdserve.engine.cpu.cpu_allocator import keep_freed_memory_for_reuse, release_free_memory
from pdserve.engine.distributed.group import RankGroup
from pdserve.engine.distributed.rank_workers import RankWorkers
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec
from pdserve.engine.kv.kv_scales import kv_scales_for
from pdserve.engine.kv.shared_kv_cache import SharedKVCache
from pdserve.engine.kv.swap_space import SwapSpace
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.llama import shard_layout
from pdserve.engine.runner.decode_batch_step import DecodeBatchStep
from pdserve.engine.runner.forward_paths import (
    DecodeBatch,
    ForwardBatch,
    ForwardPath,
    GraphReplay,
    ModelForward,
    OneTokenDecode,
    choose,
)
from pdserve.engine.runner.fp32_one_token_step import Fp32OneTokenStep
from pdserve.engine.runner.loader import load_model
from pdserve.engine.runner.memory_budget import kv_cache_budget
from pdserve.engine.runner.memory_profile import (
    CudaMemoryStats,
    MemoryProfile,
    StepShape,
    largest_decode_shape,
    max_step_shapes,
    profile_device_memory,
)
from pdserve.engine.runner.one_token_step import OneTokenStep
from pdserve.engine.sample.prompt_logprobs import ScoringPlan
from pdserve.engine.sample.sampler import Sampler, SampleResult
from pdserve.engine.sched.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.wire.limits import MAX_LOGPROBS
from pdserve.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.runner.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)


KVCacheFactory = Callable[[KVCacheSpec, int, torch.device], KVCache]
KV_SEGMENT_KEY = "kv_cache_segment"  # where rank 0 names its node cache's segment


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        kv_cache_factory: KVCacheFactory | None = None,
        memory_stats: CudaMemoryStats | None = None,
        group: RankGroup | None = None,
    ):
        """Loads the model, sizes and allocates the KV cache, then captures the CUDA graphs, in
        the order engine/runner/memory_profile.py gives. `memory_stats` measures the device for the
        KV cache's budget: by default the CUDA allocator's on a CUDA device, none on the CPU
        (where the budget is `kv_cache_memory` or a fixed default); a test passes a fake.

        Tensor parallelism (engine/distributed/): with `tensor_parallel_size` > 1 and no
        `group`, this is rank 0 and starts the worker ranks (`workers`), which build their own
        runner with their `group`; every rank holds the same number of KV blocks.

        `kv_cache_factory(spec, num_blocks, device)` allocates a one-rank engine's KV cache
        (KVCache by default; a decode node's KV receiver passes its own); a tensor-parallel
        engine allocates its own (`_allocate_kv_cache`) and takes none."""
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = config.resolve_device()
        if config.quantization is not None and self.device.type != "cpu":
            raise ValueError(
                f"quantization {config.quantization!r} runs on the CPU only, not on "
                f"{self.device}"
            )
        size = group.size if group is not None else config.tensor_parallel_size
        self.layout = shard_layout(model_config, group.rank if group is not None else 0, size)
        self.workers: RankWorkers | None = None
        if group is None and size > 1:
            self.workers = RankWorkers.start(config, model_config.path, max_model_len, self.device)
            group = self.workers.group
        self.group = group or RankGroup.single()
        dtype_choice = config.resolve_dtype(self.device, model_config.config_dtype)
        logger.info("dtype %s", dtype_choice)
        self.dtype = dtype_choice.dtype
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
        if memory_stats is None and self.device.type == "cuda":
            memory_stats = CudaMemoryStats(self.device)
        sharded = self.group.size > 1
        self.model = load_model(
            model_config, max_model_len, self.dtype, self.device, config.load_format, config.seed,
            self.layout if sharded else None, self.group if sharded else None,
            config.quantization,
        )
        if config.quantization is not None:
            logger.info(
                "linear weights quantized to %s: %.1f MiB a decode step reads",
                config.quantization, self.model.decode_weight_bytes() / 2**20,
            )
        copies = self.model.one_token_copy_bytes()
        if copies:
            logger.info(
                "one-token forwards read row-major copies of the linear weights "
                "(%.1f MiB more)", copies / 2**20,
            )
        self.sampler = Sampler(config.seed, self.device)
        self.attention_class = attention_backend_class(config.attention_backend)
        spec = KVCacheSpec(
            num_layers=model_config.num_layers,
            num_kv_heads=self.layout.num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=config.block_size,
            dtype=config.resolve_kv_cache_dtype(self.dtype),
        )
        self.kv_scales = kv_scales_for(
            spec.dtype, model_config.path, model_config.num_layers, config.load_format
        )
        self.memory_profile: MemoryProfile | None = None
        graph_buckets: list[int] = []
        if config.cuda_graphs and self.device.type == "cuda":
            from pdserve.engine.runner.cuda_graphs import decode_buckets

            graph_buckets = decode_buckets(config.max_num_seqs)
        num_blocks = self.group.min(
            config.num_kv_blocks
            or spec.num_blocks_for(self._kv_cache_budget(spec, memory_stats, graph_buckets))
        )
        self.node_kv_cache, self.kv_cache = self._allocate_kv_cache(
            spec, num_blocks, kv_cache_factory
        )
        logger.info(
            "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
            self.kv_cache.num_blocks, config.block_size, spec.dtype,
            self.kv_cache.num_blocks * spec.bytes_per_block / 2**20,
        )
        self.attention = self._attention_backend(self.kv_cache)
        self.decode_graphs = self._capture_decode_graphs() if graph_buckets else None
        self.one_token_step: OneTokenStep | Fp32OneTokenStep | None = None
        self.decode_batch_step = None
        # Where the torch backend decodes with its compiled CPU kernel, the compiled decode
        # paths run that kernel too (another backend, asked for by name, keeps every step).
        if getattr(self.attention, "cpu_decode", None) is not None:
            scale, window = self.attention.scale, self.attention.sliding_window
            logger.info(
                "building the compiled CPU decode paths (the first start on a CPU compiles them, "
                "about 20 s on 2 cores; later starts load numba's on-disk cache)"
            )
            self.one_token_step = OneTokenStep.for_model(
                self.model, self.kv_cache, scale, window
            ) or Fp32OneTokenStep.for_model(self.model, self.kv_cache, scale, window)
            self.decode_batch_step = DecodeBatchStep.for_model(
                self.model, self.kv_cache, scale, window
            )
            compiled = [
                name for name, step in (
                    ("one-sequence decode steps", self.one_token_step),
                    ("the ops between a decode batch's linears", self.decode_batch_step),
                ) if step is not None
            ]
            if compiled:
                logger.info("compiled on the CPU: %s", ", ".join(compiled))
        self.forward_paths = self._forward_paths()
        if self.device.type == "cpu":
            release_free_memory()  # what loading, packing and compiling freed

    def _forward_paths(self) -> list[ForwardPath]:
        """The paths this runner's steps may take, fastest first (engine/runner/forward_paths.py):
        those its device, model and cache allow, then the model's forward."""
        paths: list[ForwardPath] = []
        if self.decode_graphs is not None:
            paths.append(GraphReplay(self.decode_graphs))
        if self.one_token_step is not None:
            paths.append(OneTokenDecode(self.one_token_step))
        if self.decode_batch_step is not None:
            paths.append(DecodeBatch(self.decode_batch_step))
        return [*paths, ModelForward(self.model, self.attention)]

    def forward_path(self, name: str) -> ForwardPath | None:
        """This runner's path of that `name` ("model", "one_token_step", ...), None without it."""
        return next((path for path in self.forward_paths if path.name == name), None)

    def _allocate_kv_cache(
        self, spec: KVCacheSpec, num_blocks: int, factory: KVCacheFactory | None
    ) -> tuple[KVCache | None, KVCache]:
        """(the node cache, which a KV transfer moves whole; this rank's cache).

        One rank: the factory's cache is both. Tensor parallel on the CPU: every rank's shard
        lives in one SharedKVCache (engine/kv/shared_kv_cache.py) that rank 0 creates and names in
        the group's store, where each worker finds it and maps its own slice. Tensor parallel
        on CUDA: each rank allocates its own shard and there is no node cache, so the nodes
        that move KV refuse it (node/runtime.py)."""
        size = self.group.size
        if size == 1:
            cache = (factory or KVCache)(spec, num_blocks, self.device)
            return cache, cache
        if factory is not None:
            raise ValueError(
                "a tensor-parallel engine allocates its own KV cache; pass no kv_cache_factory"
            )
        if self.device.type != "cpu":
            return None, KVCache(spec, num_blocks, self.device)
        if self.group.is_first:
            node_cache = SharedKVCache.for_ranks(spec, num_blocks, size)
            self.group.publish(KV_SEGMENT_KEY, node_cache.name)
        else:
            name = self.group.published(KV_SEGMENT_KEY)
            node_cache = SharedKVCache.attach(name, spec, num_blocks, size)
        return node_cache, node_cache.rank_shard(self.group.rank)

    def _capture_decode_graphs(self) -> DecodeGraphs:
        from pdserve.engine.runner.cuda_graphs import DecodeGraphs

        config = self.config
        graphs = DecodeGraphs(
            self.model, self.attention, config.max_num_seqs, self.max_model_len,
            config.block_size, self.device,
        )
        logger.info(
            "CUDA graphs: %d decode batch sizes captured, %.1f MiB",
            len(graphs.buckets), graphs.memory_bytes / 2**20,
        )
        reserved = self.memory_profile.graph_reserve_bytes if self.memory_profile else None
        if reserved is not None and graphs.memory_bytes > reserved:
            logger.warning(
                "CUDA graphs took %.1f MiB, %.1f MiB more than the KV budget reserved for "
                "them; lower gpu_memory_utilization if steps run out of memory",
                graphs.memory_bytes / 2**20, (graphs.memory_bytes - reserved) / 2**20,
            )
        return graphs

    def _attention_backend(self, kv_cache: KVCache) -> AttentionBackend:
        model_config = self.model_config
        return self.attention_class(
            kv_cache,
            self.layout.num_heads,
            self.layout.num_kv_heads,
            model_config.head_dim,
            model_config.sliding_window,
            self.kv_scales,
        )

    def _kv_cache_budget(
        self,
        spec: KVCacheSpec,
        memory_stats: CudaMemoryStats | None,
        graph_buckets: list[int],
    ) -> int:
        config = self.config
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        if memory_stats is None:
            return DEFAULT_CPU_KV_CACHE_MEMORY
        max_steps = max_step_shapes(
            config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len
        )
        run_largest_decode = None
        kept_graph_output_bytes = 0
        if graph_buckets:
            decode = largest_decode_shape(graph_buckets[-1], self.max_model_len)

            def run_largest_decode() -> None:
                self._profile_step(spec, decode, sample=False)

            logits_row_bytes = self.model_config.vocab_size * self.dtype.itemsize
            kept_graph_output_bytes = (sum(graph_buckets) - graph_buckets[-1]) * logits_row_bytes

        def run_max_steps() -> None:
            for shape in max_steps:
                self._profile_step(spec, shape)

        memory, self.memory_profile = profile_device_memory(
            memory_stats, run_max_steps, run_largest_decode, kept_graph_output_bytes
        )
        return kv_cache_budget(memory, config.gpu_memory_utilization, config.processes_on_device)

    @torch.inference_mode()
    def _profile_step(self, spec: KVCacheSpec, shape: StepShape, sample: bool = True) -> None:
        """A forward (and, with `sample`, sampling with every filter on) of a step of `shape`,
        over a one-block throwaway KV cache every block table points at; for its peak memory."""
        device = self.device
        backend = self._attention_backend(KVCache(spec, 1, device))
        num_seqs = len(shape.chunk_lens)
        width = -(-(shape.context_len + max(shape.chunk_lens)) // spec.block_size)
        batch = build_flat_batch(
            token_chunks=[[0] * n for n in shape.chunk_lens],
            context_lens=[shape.context_len] * num_seqs,
            block_tables=[[0] * width] * num_seqs,
            sample_flags=[True] * num_seqs,
            block_size=spec.block_size,
            device=device,
        )
        logits = self.model(
            batch.input_ids, batch.positions, batch.logits_indices, backend, backend.prepare(batch)
        )
        if sample and logits is not None:  # None: a worker rank's (rank 0 samples)
            params = SamplingParams(
                temperature=1.0, top_p=0.9, top_k=50, seed=0, logprobs=MAX_LOGPROBS, max_tokens=1,
                presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, min_p=0.05,
                logit_bias={0: 1.0},
            )
            seqs = [
                Sequence(f"profile-{i}", [0] * (shape.context_len + n), params, frozenset(), device)
                for i, n in enumerate(shape.chunk_lens)
            ]
            self.sampler(logits, seqs)

    def new_swap_space(self, swap_space_bytes: int) -> SwapSpace:
        """Host memory for swapped-out KV; under tensor parallelism each swap is mirrored by
        every worker rank on its own shard."""
        if self.workers is not None:
            return self.workers.swap_space(self.kv_cache, swap_space_bytes)
        return SwapSpace.for_budget(self.kv_cache, swap_space_bytes)

    def close(self) -> None:
        """Stops the worker ranks and unlinks their shared KV cache (tensor parallelism);
        nothing to do otherwise."""
        if self.workers is not None:
            self.workers.close()
            if isinstance(self.node_kv_cache, SharedKVCache):
                self.node_kv_cache.close()

    def synchronize(self) -> None:
        """Waits for the device's queued work (CUDA); nothing to wait for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput, layers_done: Callable[[int], None] | None = None
    ) -> list[tuple[Sequence, SampleResult]]:
        """Runs the step; returns a sample for each sequence whose chunk reached its end (for
        each of its children instead, when it has some: engine/forks.py). `layers_done(n)` is
        called as the model's own forward finishes its n-th layer (not by the other forward
        paths, engine/runner/forward_paths.py)."""
        self.kv_cache.copy_blocks(step.blocks_to_copy)
        ordered = sorted(step.scheduled, key=lambda s: s.num_new_tokens != 1)
        batch = build_flat_batch(
            token_chunks=[
                s.seq.token_ids[
                    s.seq.num_computed_tokens : s.seq.num_computed_tokens + s.num_new_tokens
                ]
                for s in ordered
            ],
            context_lens=[s.seq.num_computed_tokens for s in ordered],
            block_tables=[s.seq.block_table for s in ordered],
            sample_flags=[s.completes_prompt for s in ordered],
            block_size=self.config.block_size,
            device=self.device,
        )
        scoring = ScoringPlan.for_step(ordered, batch.query_start, self.device)
        logits_indices = batch.logits_indices
        if scoring is not None:  # prompt logprobs: their rows after the sampled ones
            logits_indices = torch.cat((logits_indices, scoring.rows))
        if self.workers is not None:
            self.workers.send_step(step.blocks_to_copy, batch, logits_indices)
        forward = ForwardBatch(
            batch, logits_indices, scores_prompts=scoring is not None, layers_done=layers_done
        )
        logits = choose(self.forward_paths, forward).run(forward)
        if scoring is not None:
            num_sampled = batch.logits_indices.numel()
            scoring.record(logits[num_sampled:])
            logits = logits[:num_sampled]
        sampled = [s.seq for s in ordered if s.completes_prompt]
        if not sampled:
            return []
        rows = [row for seq in sampled for row in seq.children or [seq]]
        if len(rows) != len(sampled):  # a prompt's last position, sampled once per child
            repeats = torch.tensor([seq.num_seqs for seq in sampled], device=logits.device)
            logits = logits.repeat_interleave(repeats, dim=0)
        return list(zip(rows, self.sampler(logits, rows)))
