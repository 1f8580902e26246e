"""Warm-up compiles every kernel variant before a node reports ready, and leaves nothing behind
but the measured prefill speed; measured prefill steps include their device work (CUDA)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sample.sampler import SampleResult
from pdserve.engine.stats_report import scheduling_stats
from pdserve.engine.warm_up import WARM_UP_MAX_TOKENS, WARM_UP_SHORT_PROMPT_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def new_engine(model_dir, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, **config))


def greedy_tokens(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("r", prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens += output.new_token_ids
    return tokens


def record_steps(engine: LLMEngine, monkeypatch) -> list[list[tuple[int, int]]]:
    """Each executed step as (context length, new tokens) per sequence, in schedule order."""
    steps: list[list[tuple[int, int]]] = []
    execute = engine.runner.execute

    def recording_execute(step, layers_done=None):
        steps.append([(s.seq.num_computed_tokens, s.num_new_tokens) for s in step.scheduled])
        return execute(step, layers_done)

    monkeypatch.setattr(engine.runner, "execute", recording_execute)
    return steps


def forbid_cuda_sync(monkeypatch) -> None:
    def no_sync(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize called on the CPU")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)


def engine_state(engine: LLMEngine) -> dict:
    manager = engine.block_manager
    return {
        "free_blocks": sorted(manager.free_block_ids),
        "num_free_blocks": manager.num_free_blocks,
        "cached_blocks": manager.num_cached_blocks,
        "prefix_stats": repr(manager.prefix_cache.stats),
        "sequences": dict(engine.sequences),
        "held": dict(engine.held_blocks.counts),
        "unfinished": engine.scheduler.num_unfinished,
        "preemptions": engine.scheduler.num_preemptions,
        # the measured prefill speed is what warm-up is for (asserted below)
        "scheduling": replace(scheduling_stats(engine), prefill_tokens_per_s=0.0),
        "sampler_state": engine.runner.sampler.generator.get_state().tolist(),
        "copy_speed": (engine.preemption.copy_bytes_per_s, engine.preemption.copy_measured),
    }


def test_warm_up_of_every_kernel_variant_leaves_nothing_but_the_prefill_speed(
    tiny_llama_dir, monkeypatch
):
    engine = new_engine(tiny_llama_dir)
    before = engine_state(engine)
    steps = record_steps(engine, monkeypatch)
    engine.warm_up(kernel_variants=True)
    n, m = WARM_UP_MAX_TOKENS, WARM_UP_SHORT_PROMPT_TOKENS
    assert steps == [
        [(0, n)],  # the prefill, paying one-time costs
        [(0, n)],  # again, timed
        [(n, 1), (0, m)],  # mixed: a decode beside a prefill
        [(n + 1, 1), (m, 1)],  # a decode batch
        [(m + 1, 1)],  # a decode alone
    ]
    assert engine_state(engine) == before
    assert engine.preemption.measured_prefill_tokens_per_s > 0
    engine.check_integrity()
    prompt = list(range(3, 40))
    assert greedy_tokens(engine, prompt) == greedy_tokens(new_engine(tiny_llama_dir), prompt)


def test_on_the_cpu_warm_up_is_by_default_the_two_pass_prefill_and_never_syncs_cuda(
    tiny_llama_dir, monkeypatch
):
    engine = new_engine(tiny_llama_dir)
    steps = record_steps(engine, monkeypatch)
    forbid_cuda_sync(monkeypatch)
    engine.warm_up()
    assert steps == [[(0, WARM_UP_MAX_TOKENS)]] * 2


def test_on_cuda_warm_up_by_default_runs_every_variant_and_waits_for_the_device(
    tiny_llama_dir, monkeypatch
):
    engine = new_engine(tiny_llama_dir)
    events: list[str] = []

    def fake_execute(step, layers_done=None):
        events.append(f"execute {[s.num_new_tokens for s in step.scheduled]}")
        return [(s.seq, SampleResult(7, None)) for s in step.scheduled if s.completes_prompt]

    monkeypatch.setattr(engine.runner, "device", torch.device("cuda"))
    monkeypatch.setattr(engine.runner, "execute", fake_execute)
    monkeypatch.setattr(engine.runner, "synchronize", lambda: events.append("synchronize"))
    engine.warm_up()
    n, m = WARM_UP_MAX_TOKENS, WARM_UP_SHORT_PROMPT_TOKENS
    assert events == [
        f"execute {[n]}", "synchronize",
        f"execute {[n]}", "synchronize",
        f"execute {[1, m]}", "execute [1, 1]", "execute [1]", "synchronize",
    ]
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_warm_up_with_too_few_free_blocks_does_what_fits(tiny_llama_dir, monkeypatch):
    engine = new_engine(tiny_llama_dir, max_num_batched_tokens=32)
    steps = record_steps(engine, monkeypatch)
    engine.warm_up(kernel_variants=True)
    assert steps[0] == [(0, 32)] and len(steps) == 5
    held = engine.block_manager.allocate_blocks(engine.block_manager.num_free_blocks - 1)
    steps.clear()
    engine.warm_up(kernel_variants=True)  # one free block: not even the prefill fits
    assert steps == []
    engine.block_manager.release_blocks(held)
    engine.check_integrity()


def test_a_measured_prefill_step_includes_the_device_work(tiny_llama_dir, monkeypatch):
    engine = new_engine(tiny_llama_dir)
    device_seconds, syncs = 0.3, []

    def slow_device_sync():  # the kernels still running when execute() returns
        syncs.append(time.perf_counter())
        time.sleep(device_seconds)

    monkeypatch.setattr(engine.runner, "synchronize", slow_device_sync)
    prompt_tokens = 200
    greedy_tokens(engine, [3 + i % 500 for i in range(prompt_tokens)])
    assert len(syncs) == 1  # the prefill step only: decode steps are not measured
    assert engine.preemption.measured_prefill_tokens_per_s <= prompt_tokens / device_seconds


def test_on_the_cpu_step_timing_costs_no_device_sync(tiny_llama_dir, monkeypatch):
    engine = new_engine(tiny_llama_dir)
    forbid_cuda_sync(monkeypatch)
    greedy_tokens(engine, list(range(3, 203)))
    assert engine.preemption.measured_prefill_tokens_per_s > 0


@pytest.mark.parametrize("max_model_len", [3, 20])
def test_warm_up_fits_a_short_maximum_context(tiny_llama_dir, monkeypatch, max_model_len):
    engine = new_engine(tiny_llama_dir, max_model_len=max_model_len)
    steps = record_steps(engine, monkeypatch)
    engine.warm_up(kernel_variants=True)
    for step in steps:
        for context_len, new_tokens in step:
            assert context_len + new_tokens <= max_model_len
    engine.check_integrity()
