"""Preemption by recompute, swap and auto: identical greedy tokens under KV pressure (with shared
prefix blocks), every device and host block back afterwards, and the cost model's choice."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sched.preemption import PreemptionPolicy

GREEDY = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)


def pressure_prompts(seed: int = 3, pairs: int = 4) -> list[list[int]]:
    """`pairs` pairs of prompts sharing a 40-token prefix (2.5 blocks), so preempted sequences
    hold blocks that the prefix cache and their partner also hold (copy-on-write)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(pairs):
        prefix = [rng.randrange(3, 500) for _ in range(40)]
        for _ in range(2):
            prompts.append(prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))])
    return prompts


def check_everything_returned(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if engine.swap_space is not None:
        assert engine.swap_space.num_free == engine.swap_space.num_blocks


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    outputs = llm.generate(pressure_prompts(), GREEDY)
    assert llm.engine.scheduler.num_preemptions == 0
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("budget", [2048, 24])
def test_greedy_tokens_are_identical_whatever_cures_the_preemption(
    tiny_llama_dir, reference_tokens, mode, budget
):
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=14,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        prefix_cache_min_blocks=1,
    )
    outputs = llm.generate(pressure_prompts(), GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens
    by_mode = llm.engine.scheduler.num_preemptions_by_mode
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(by_mode.values()) == llm.engine.scheduler.num_preemptions
    if mode == "recompute":
        assert by_mode["swap"] == 0 and llm.engine.swap_space is None
    if mode == "swap":
        assert by_mode["recompute"] == 0
    if by_mode["swap"]:
        swap = llm.engine.swap_space
        assert swap.bytes_out_total > 0 and swap.bytes_in_total == swap.bytes_out_total
    check_everything_returned(llm)


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full(
    tiny_llama_dir, reference_tokens
):
    none = LLM(
        str(tiny_llama_dir), dtype="float32", num_kv_blocks=14, preemption_mode="swap",
        swap_space=1,
    )
    assert none.engine.swap_space is None
    bytes_per_block = none.engine.runner.kv_cache.spec.bytes_per_block
    small = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=14,
        preemption_mode="swap",
        swap_space=3 * bytes_per_block,
    )
    outputs = small.generate(pressure_prompts(), GREEDY)
    assert [o.token_ids for o in outputs] == reference_tokens
    by_mode = small.engine.scheduler.num_preemptions_by_mode
    assert by_mode["recompute"] > 0
    check_everything_returned(small)


def test_aborting_a_swapped_out_request_frees_its_host_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=14, preemption_mode="swap")
    engine = llm.engine
    for index, prompt in enumerate(pressure_prompts()):
        engine.add_request(f"r{index}", prompt, GREEDY)
    swapped = []
    for _ in range(200):
        engine.step()
        swapped = [s for s in engine.sequences.values() if s.host_block_table]
        if swapped:
            break
    assert swapped, "no sequence was swapped out"
    assert engine.swap_space.num_free < engine.swap_space.num_blocks
    for request_id in list(engine.sequences):
        engine.abort_request(request_id)
    check_everything_returned(llm)


def test_the_cost_model_picks_the_cheaper_cure():
    policy = PreemptionPolicy("auto", bytes_per_token=100_000)
    for _ in range(50):
        policy.observe_prefill(10_000, 0.1)  # 100k tokens/s: recompute is cheap
        policy.observe_copy(1 << 30, 1.0)  # 1 GiB/s: 2 x 100 kB per token costs 186 us
    assert not policy.prefers_swap(1_000)
    for _ in range(50):
        policy.observe_prefill(1_000, 1.0)  # 1k tokens/s: 1 ms per token
    assert policy.prefers_swap(1_000)
    assert PreemptionPolicy("recompute", 1).prefers_swap(10**6) is False
    assert PreemptionPolicy("swap", 10**9).prefers_swap(1) is True
    with pytest.raises(ValueError, match="preemption mode"):
        PreemptionPolicy("sometimes", 1)
