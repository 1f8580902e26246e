"""The KV cache is sized after the weights load, after `empty_cache()`, and after profiling
forwards at the largest step (and, with CUDA graphs, the largest graph's decode), with a fake
device at the seam: the same order and arithmetic the CUDA allocator's statistics get."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pdserve.engine.kv.kv_cache import KVCache
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.runner.memory_budget import kv_cache_budget
from pdserve.engine.runner.memory_profile import (
    StepShape,
    largest_decode_shape,
    max_step_shapes,
    profile_device_memory,
)
from pdserve.engine.runner.model_runner import ModelRunner

GIB = 1 << 30
MIB = 1 << 20


class FakeMemoryStats:
    """A device whose allocator numbers the test sets; every call is logged in order."""

    device = "cuda:0"

    def __init__(self, total: int, reserved: int, free: int) -> None:
        self.calls: list[str] = []
        self.total, self.current, self.free = total, reserved, free
        self.peak = reserved
        self.peak_alloc = reserved

    def record(self, name: str) -> None:
        self.calls.append(name)

    def synchronize(self) -> None:
        self.record("synchronize")

    def empty_cache(self) -> None:
        self.record("empty_cache")

    def reset_peak(self) -> None:
        self.record("reset_peak")
        self.peak = self.peak_alloc = self.current

    def allocated(self) -> int:
        return self.current

    def peak_allocated(self) -> int:
        return self.peak_alloc

    def reserved(self) -> int:
        return self.current

    def peak_reserved(self) -> int:
        return self.peak

    def free_and_total(self) -> tuple[int, int]:
        self.record("free_and_total")
        return self.free, self.total

    def run(self, name: str, peak_extra: int):
        """A profiling forward that briefly allocates `peak_extra` bytes."""

        def forward() -> None:
            self.record(name)
            self.peak = max(self.peak, self.current + peak_extra)
            self.peak_alloc = max(self.peak_alloc, self.current + peak_extra)

        return forward


def test_the_budget_is_measured_after_empty_cache_and_the_profiling_forwards():
    stats = FakeMemoryStats(total=100 * GIB, reserved=16 * GIB, free=80 * GIB)
    memory, profile = profile_device_memory(
        stats,
        run_max_steps=stats.run("max_steps", 3 * GIB),
        run_largest_decode=stats.run("largest_decode", 1 * GIB),
        kept_graph_output_bytes=GIB // 2,
    )
    calls = stats.calls
    assert calls[:2] == ["synchronize", "empty_cache"]
    assert calls.index("largest_decode") < calls.index("max_steps")
    assert calls[calls.index("max_steps") - 1] == "reset_peak"
    assert calls[-2:] == ["empty_cache", "free_and_total"]
    assert profile.weights_bytes == 16 * GIB
    assert profile.activation_bytes == 3 * GIB
    assert profile.graph_reserve_bytes == GIB + GIB // 2
    assert memory.process_bytes == 16 * GIB + 3 * GIB + GIB + GIB // 2
    assert memory.free_bytes == 80 * GIB - 3 * GIB - GIB - GIB // 2
    # 90 GiB for this process: weights, the activation peak and the graphs come off it.
    assert kv_cache_budget(memory, 0.9, 1) == int(90 * GIB) - 16 * GIB - 3 * GIB - 3 * GIB // 2


def test_without_graphs_nothing_is_reserved_for_them():
    stats = FakeMemoryStats(total=100 * GIB, reserved=16 * GIB, free=80 * GIB)
    memory, profile = profile_device_memory(stats, stats.run("max_steps", 2 * GIB))
    assert "largest_decode" not in stats.calls
    assert profile.graph_reserve_bytes == 0
    assert memory.process_bytes == 18 * GIB


def test_the_free_memory_caps_the_budget_when_another_process_holds_more_than_its_share():
    stats = FakeMemoryStats(total=100 * GIB, reserved=16 * GIB, free=30 * GIB)
    memory, _ = profile_device_memory(stats, stats.run("max_steps", 2 * GIB))
    assert kv_cache_budget(memory, 0.9, 1) == 28 * GIB


def test_the_largest_steps_use_the_whole_token_budget_and_every_sequence_slot():
    widest, longest = max_step_shapes(2048, 256, 8192)
    assert widest == StepShape((8,) * 256, 0)
    assert longest == StepShape((2048,), 8192 - 2048)
    widest, longest = max_step_shapes(300, 256, 4096)
    assert sum(widest.chunk_lens) == 300 and len(widest.chunk_lens) == 256
    assert list(widest.chunk_lens) == sorted(widest.chunk_lens)  # decodes (1 token) first
    assert max_step_shapes(512, 1, 256) == [StepShape((256,), 0)]  # one max-length sequence
    assert largest_decode_shape(256, 8192) == StepShape((1,) * 256, 8191)


def test_a_runner_profiles_its_real_forwards_before_it_allocates_the_kv_cache(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir), max_num_batched_tokens=96, max_num_seqs=8, block_size=16
    )
    model_config = ModelConfig.from_folder(tiny_llama_dir)
    stats = FakeMemoryStats(total=64 * MIB, reserved=8 * MIB, free=56 * MIB)
    forwards: list[tuple[int, int]] = []
    events = stats.calls

    def kv_cache_factory(spec, num_blocks, device):
        events.append("allocate_kv_cache")
        return KVCache(spec, num_blocks, device)

    from pdserve.engine.runner import model_runner as runner_module

    real_load = runner_module.load_model

    def load_and_watch(*args, **kwargs):
        events.append("load_model")
        model = real_load(*args, **kwargs)

        def hook(module, inputs, output):
            events.append("forward")
            forwards.append((inputs[0].numel(), output.shape[0]))
            stats.peak = max(stats.peak, stats.current + 2 * MIB)

        model.register_forward_hook(hook)
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "load_model", load_and_watch)
        runner = ModelRunner(config, model_config, 256, kv_cache_factory, memory_stats=stats)

    assert events.index("load_model") < events.index("empty_cache") < events.index("forward")
    last_forward = len(events) - 1 - events[::-1].index("forward")
    assert events[last_forward + 1 :] == [
        "synchronize", "empty_cache", "free_and_total", "allocate_kv_cache"
    ]
    # The widest step: every token of the budget over every sequence slot, each one sampled;
    # the longest: one chunk of the whole budget ending at max_model_len.
    assert forwards == [(96, 8), (96, 1)]
    spec = runner.kv_cache.spec
    budget = int(64 * MIB * config.gpu_memory_utilization) - 8 * MIB - 2 * MIB
    assert runner.kv_cache.num_blocks == budget // spec.bytes_per_block
    # Profiling samples with seeded sequences: the engine's own generator is untouched.
    fresh = torch.Generator().manual_seed(config.seed)
    assert torch.equal(runner.sampler.generator.get_state(), fresh.get_state())


def test_on_the_cpu_nothing_is_profiled_and_the_budget_is_the_fixed_default(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir))
    runner = ModelRunner(config, ModelConfig.from_folder(tiny_llama_dir), 256)
    spec = runner.kv_cache.spec
    assert runner.kv_cache.num_blocks == DEFAULT_CPU_KV_CACHE_MEMORY // spec.bytes_per_block


def test_a_share_too_small_for_the_weights_and_activations_names_every_number(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), gpu_memory_utilization=0.1)
    stats = FakeMemoryStats(total=10 * GIB, reserved=2 * GIB, free=8 * GIB)
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        ModelRunner(config, ModelConfig.from_folder(tiny_llama_dir), 256, memory_stats=stats)
