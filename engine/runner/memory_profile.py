"""What a CUDA engine holds besides its KV cache, profiled before the KV cache is allocated.

The model runner's start-up on CUDA, each step finished before the next begins:
  1. the weights load, built directly in their dtype (engine/runner/loader.py);
  2. `empty_cache()`: what loading freed goes back to the device and stops counting as used;
  3. with CUDA graphs, a decode forward at the largest graph bucket over block tables as long
     as `max_model_len` (the shapes the graphs are captured with): its peak allocation, plus
     the logits buffer each smaller bucket's graph keeps, is the graph reserve. A captured
     graph holds its memory in a private pool that eager steps cannot reuse, so this comes
     on top of the activation peak;
  4. `empty_cache()` and the peak statistics reset, then the largest steps the scheduler can
     build (`max_step_shapes`), each a forward plus sampling with every filter on: the
     allocator's peak reservation now covers the weights and the largest activations;
  5. `empty_cache()`, then the device is measured (`DeviceMemory`): the process holds its
     peak reservation plus the graph reserve, and of the device's free memory the KV cache
     may take what the activations and the graphs will not take back. engine/runner/memory_budget.py
     turns that into the KV cache's bytes (this process's share of the device);
  6. the KV cache is allocated, then the graphs are captured (engine/runner/cuda_graphs.py).
The profiling forwards read and write a one-block throwaway cache that every block table
points at: activations do not depend on the values of the keys they read.
On the CPU nothing is profiled: the KV cache gets `kv_cache_memory` or a fixed default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.runner.memory_budget import DeviceMemory

MIB = 1 << 20

logger = logging.getLogger(__name__)


class CudaMemoryStats:
    """The caching allocator's statistics and the driver's free/total for one CUDA device;
    the seam tests replace with a fake."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def free_and_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)


@dataclass(frozen=True)
class StepShape:
    """A profiling step: sequences with `chunk_lens` new tokens each (in the order the model
    runner puts them: decodes first), every one after `context_len` cached tokens."""

    chunk_lens: tuple[int, ...]
    context_len: int


def max_step_shapes(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[StepShape]:
    """The largest steps the scheduler can build, which between them reach every peak:
    the whole token budget spread over as many sequences as may run (the most sampled rows:
    logits and sampler temporaries), and one chunk as long as the budget allows ending at
    `max_model_len` (the most keys one sequence attends, for backends whose attention memory
    grows with them)."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_seqs * max_model_len)
    base, extra = divmod(num_tokens, num_seqs)
    widest = StepShape((base,) * (num_seqs - extra) + (base + 1,) * extra, 0)
    chunk = min(max_num_batched_tokens, max_model_len)
    longest = StepShape((chunk,), max_model_len - chunk)
    return [widest] if longest == widest else [widest, longest]


def largest_decode_shape(largest_bucket: int, max_model_len: int) -> StepShape:
    """The decode step the largest CUDA graph is captured for: every sequence at full length."""
    return StepShape((1,) * largest_bucket, max_model_len - 1)


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes, measured at start-up: what the process holds after loading (the weights), the
    extra its largest step allocates at its peak, and what its CUDA graphs will hold."""

    weights_bytes: int
    activation_bytes: int
    graph_reserve_bytes: int

    def describe(self) -> str:
        return (
            f"weights {self.weights_bytes / MIB:,.0f} MiB, peak activations "
            f"{self.activation_bytes / MIB:,.0f} MiB, "
            f"CUDA graphs {self.graph_reserve_bytes / MIB:,.0f} MiB"
        )


def profile_device_memory(
    stats: CudaMemoryStats,
    run_max_steps: Callable[[], None],
    run_largest_decode: Callable[[], None] | None = None,
    kept_graph_output_bytes: int = 0,
) -> tuple[DeviceMemory, MemoryProfile]:
    """Runs the profile in the module docstring's order (steps 2 to 5) and measures the device.

    `run_max_steps` runs the largest eager steps; `run_largest_decode`, when graphs will be
    captured, the largest graph bucket's decode forward; `kept_graph_output_bytes` is what the
    other buckets' graphs keep besides (their logits buffers)."""
    stats.synchronize()
    stats.empty_cache()
    graph_reserve = 0
    if run_largest_decode is not None:
        stats.reset_peak()
        before = stats.allocated()
        run_largest_decode()
        stats.synchronize()
        graph_reserve = stats.peak_allocated() - before + kept_graph_output_bytes
        stats.empty_cache()
    stats.reset_peak()
    weights = stats.reserved()
    run_max_steps()
    stats.synchronize()
    peak = stats.peak_reserved()
    stats.empty_cache()
    free, total = stats.free_and_total()
    activation = max(peak - weights, 0)
    profile = MemoryProfile(weights, activation, graph_reserve)
    memory = DeviceMemory(
        total_bytes=total,
        free_bytes=free - activation - graph_reserve,
        process_bytes=peak + graph_reserve,
        device_name=str(getattr(stats, "device", "the device")),
    )
    logger.info("device memory profile: %s", profile.describe())
    return memory, profile
