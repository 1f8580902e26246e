"""How many bytes of device memory the KV cache gets, when node processes may share one GPU.

The processes placed on one device (`processes_on_device`, which the launcher counts) may hold
`gpu_memory_utilization` of its memory together, in equal shares. A process's KV cache gets its
share minus what the process holds when the budget is measured (engine/runner/memory_profile.py: the
weights, the peak activations of the largest step, the CUDA graphs' reserve), and never more
than the device has free for it, in case another process holds more than its share.

Not counted: the CUDA context and memory allocated outside torch's allocator (a few hundred
MiB); the `1 - gpu_memory_utilization` left over pays for them.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as one process sees it, in bytes: the device's total, what of its
    free memory the KV cache could take, and what this process holds or will take back."""

    total_bytes: int
    free_bytes: int
    process_bytes: int
    device_name: str = "the device"


def kv_cache_budget(
    memory: DeviceMemory, gpu_memory_utilization: float, processes_on_device: int
) -> int:
    """Bytes for this process's KV cache; ValueError when its share leaves none."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    if processes_on_device < 1:
        raise ValueError(f"processes_on_device must be >= 1, got {processes_on_device}")
    share_bytes = int(memory.total_bytes * gpu_memory_utilization / processes_on_device)
    budget = min(share_bytes - memory.process_bytes, memory.free_bytes)
    if budget <= 0:
        raise ValueError(
            f"no memory is left for the KV cache on {memory.device_name}: this process's "
            f"share is {gpu_memory_utilization:g} x {memory.total_bytes / GIB:.1f} GiB / "
            f"{processes_on_device} process(es) = {share_bytes / GIB:.1f} GiB, it already holds "
            f"{memory.process_bytes / GIB:.1f} GiB (weights, activations) and "
            f"{memory.free_bytes / GIB:.1f} GiB of the device is free; raise "
            "gpu_memory_utilization (--gpu-memory-utilization), place fewer processes on the "
            "device, or give kv_cache_memory (--kv-cache-memory)"
        )
    return budget
