"""The KV cache's share of a GPU shared by node processes (engine/runner/memory_budget.py), on
made-up device numbers: each process gets `gpu_memory_utilization / processes_on_device` of the
device minus what it holds, whichever process measures first, and never more than is free."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.runner.memory_budget import DeviceMemory, kv_cache_budget

GIB = 1 << 30
TOTAL = 80 * GIB
CONTEXT = GIB // 2  # the CUDA context: outside torch's allocator
WEIGHTS = 16 * GIB


def test_one_process_gets_the_utilization_minus_its_weights():
    memory = DeviceMemory(TOTAL, TOTAL - CONTEXT - WEIGHTS, WEIGHTS)
    assert kv_cache_budget(memory, 0.9, 1) == int(0.9 * TOTAL) - WEIGHTS


def test_two_processes_on_one_gpu_each_get_their_share_whichever_measures_first():
    share = int(0.9 * TOTAL / 2)
    first = kv_cache_budget(DeviceMemory(TOTAL, TOTAL - CONTEXT - WEIGHTS, WEIGHTS), 0.9, 2)
    assert first == share - WEIGHTS
    # The second process measures after the first allocated its KV cache.
    used_by_first = CONTEXT + WEIGHTS + first
    second = kv_cache_budget(
        DeviceMemory(TOTAL, TOTAL - used_by_first - CONTEXT - WEIGHTS, WEIGHTS), 0.9, 2
    )
    assert second == first
    assert 2 * (CONTEXT + WEIGHTS) + first + second <= TOTAL


def test_the_budget_never_exceeds_what_is_free():
    squatter = 60 * GIB  # another program's memory on the device
    memory = DeviceMemory(TOTAL, TOTAL - squatter - CONTEXT - WEIGHTS, WEIGHTS)
    assert kv_cache_budget(memory, 0.9, 1) == memory.free_bytes


def test_a_share_smaller_than_the_weights_names_every_number():
    memory = DeviceMemory(TOTAL, TOTAL - CONTEXT - 40 * GIB, 40 * GIB, "cuda:0")
    with pytest.raises(ValueError) as raised:
        kv_cache_budget(memory, 0.9, 2)
    message = str(raised.value)
    assert "cuda:0" in message and "0.9 x 80.0 GiB / 2 process(es) = 36.0 GiB" in message
    assert "already holds 40.0 GiB" in message and "--gpu-memory-utilization" in message


@pytest.mark.parametrize(
    ("utilization", "processes", "message"),
    [(0.0, 1, "gpu_memory_utilization"), (1.5, 1, "gpu_memory_utilization"),
     (0.9, 0, "processes_on_device")],
)
def test_out_of_range_settings_are_refused(utilization, processes, message):
    with pytest.raises(ValueError, match=message):
        kv_cache_budget(DeviceMemory(TOTAL, TOTAL, 0), utilization, processes)


def test_engine_config_fields_size_the_share():
    config = EngineConfig(gpu_memory_utilization=0.8, processes_on_device=2)
    memory = DeviceMemory(TOTAL, TOTAL - CONTEXT - WEIGHTS, WEIGHTS)
    budget = kv_cache_budget(memory, config.gpu_memory_utilization, config.processes_on_device)
    assert budget == int(0.8 * TOTAL / 2) - WEIGHTS
