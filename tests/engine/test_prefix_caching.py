"""Prefix caching in the engine: admission reuses cached blocks, shortages evict before they
preempt, and greedy tokens with the cache on equal those with it off, evictions included."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)


def make_seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(), frozenset(), torch.device("cpu"))


def run_to_completion(scheduler: Scheduler, seqs: list[Sequence], new_tokens: int = 1) -> None:
    """Steps the scheduler as the engine does (without a model) until every seq finishes."""
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.num_unfinished:
        for scheduled in scheduler.schedule().scheduled:
            seq = scheduled.seq
            samples = scheduled.completes_prompt
            seq.num_computed_tokens += scheduled.num_new_tokens
            scheduler.block_manager.cache_computed_blocks(seq)
            if samples:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= new_tokens:
                    scheduler.finish(seq, "length")


def test_admission_reuses_the_cached_prefix_but_computes_the_last_token():
    manager = BlockManager(16, 4, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4)
    run_to_completion(scheduler, [make_seq("first", list(range(12)))])
    again = make_seq("again", list(range(12)))
    longer = make_seq("longer", list(range(14)))
    scheduler.add(again)
    scheduler.add(longer)
    chunks = {s.seq.request_id: s.num_new_tokens for s in scheduler.schedule().scheduled}
    assert chunks == {"again": 4, "longer": 2}
    assert again.num_cached_tokens == 8 and longer.num_cached_tokens == 12
    assert again.block_table[:2] == longer.block_table[:2]
    stats = manager.prefix_cache.stats
    assert (stats.queries, stats.hits) == (12 + 12 + 14, 8 + 12)
    manager.check_integrity([again.block_table, longer.block_table])


def test_identical_prompts_computed_together_end_up_sharing_one_copy():
    manager = BlockManager(16, 4, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(9)))
    scheduler.add(a)
    scheduler.add(b)
    for scheduled in scheduler.schedule().scheduled:
        scheduled.seq.num_computed_tokens += scheduled.num_new_tokens
        manager.cache_computed_blocks(scheduled.seq)
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert manager.pool.num_free == 16 - 4
    manager.check_integrity([a.block_table, b.block_table])


def test_a_shortage_evicts_cached_blocks_before_preempting_anything():
    manager = BlockManager(8, 4, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4, watermark=0)
    run_to_completion(scheduler, [make_seq("old", list(range(100, 124)))])
    assert manager.num_cached_blocks == 6 and manager.num_free_blocks == 8
    run_to_completion(scheduler, [make_seq("new", list(range(28)))], new_tokens=4)
    assert scheduler.num_preemptions == 0
    assert manager.prefix_cache.stats.evicted_blocks >= 6
    manager.check_integrity([])
    assert manager.num_free_blocks == 8


def test_cache_off_keeps_nothing():
    manager = BlockManager(8, 4)
    scheduler = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4)
    run_to_completion(scheduler, [make_seq("a", list(range(20)))])
    run_to_completion(scheduler, [b := make_seq("b", list(range(20)))])
    assert b.num_cached_tokens == 0 and manager.num_cached_blocks == 0
    assert manager.pool.num_free == 8


SHARED_LENGTHS = (0, 1, 15, 16, 17, 100)


def shared_prefix_prompts(seed: int = 1) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 500) for _ in range(130)]
    variants = []
    for shared in SHARED_LENGTHS:
        suffix = [rng.randrange(3, 500) for _ in range(40)]
        if suffix[0] == base[shared]:
            suffix[0] = base[shared] + 1
        variants.append(base[:shared] + suffix)
    return base, variants


def check_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="module")
def cache_off_tokens(tiny_llama_dir):
    base, variants = shared_prefix_prompts()
    llm = LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    outputs = llm.generate([base, *variants, base], GREEDY)
    check_clean(llm)
    return [o.token_ids for o in outputs]


def test_greedy_tokens_with_the_cache_equal_tokens_without_it(tiny_llama_dir, cache_off_tokens):
    base, variants = shared_prefix_prompts()
    llm = LLM(str(tiny_llama_dir), dtype="float32", prefix_cache_min_blocks=1)
    first = llm.generate([base], GREEDY)
    rest = llm.generate([*variants, base], GREEDY)
    assert [o.token_ids for o in first + rest] == cache_off_tokens
    reused = [o.num_cached_tokens for o in rest]
    assert reused == [0, 0, 0, 16, 16, 96, 128]
    check_clean(llm)


def test_greedy_tokens_hold_when_the_cache_evicts_mid_run(tiny_llama_dir, cache_off_tokens):
    base, variants = shared_prefix_prompts()
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64,
        prefix_cache_min_blocks=1,
    )
    first = llm.generate([base], GREEDY)
    rest = llm.generate([*variants, base], GREEDY)
    assert [o.token_ids for o in first + rest] == cache_off_tokens
    assert llm.engine.block_manager.prefix_cache.stats.evicted_blocks > 0
    assert any(o.num_cached_tokens > 0 for o in rest)
    check_clean(llm)


def test_a_second_chat_turn_reuses_the_first_turns_generated_tokens(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(50)]
    first = llm.generate([prompt], GREEDY)[0]
    history = prompt + first.token_ids
    second = llm.generate([history + [rng.randrange(3, 500) for _ in range(10)]], GREEDY)[0]
    assert second.num_cached_tokens == (len(history) - 1) // 16 * 16 > len(prompt)
    check_clean(llm)
