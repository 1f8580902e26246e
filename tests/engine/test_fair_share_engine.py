"""Fair share through the real engine: one request of 8 prompts x n=8 fills the batch; a
request submitted after it samples its first token in the first step after it arrives (the
bound in engine/sched/scheduler.py), and the big request's greedy tokens are those it gets alone."""

from __future__ import annotations

import random

from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NUM_PROMPTS, N = 8, 8


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def new_engine(tiny_llama_dir) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=16
    )
    return LLMEngine(config)


def add_big_request(engine: LLMEngine) -> None:
    for p in range(NUM_PROMPTS):
        choices = [(f"big-{p * N + i}", GREEDY) for i in range(N)]
        engine.add_request(f"big-p{p}", prompt_of(12, p), GREEDY, choices=choices, group="big")


def run(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)


def test_a_request_after_a_big_one_gets_its_first_token_in_its_first_step(tiny_llama_dir):
    alone = new_engine(tiny_llama_dir)
    add_big_request(alone)
    alone_tokens: dict[str, list[int]] = {}
    run(alone, alone_tokens)

    engine = new_engine(tiny_llama_dir)
    assert engine.scheduler.shares.share == 4
    add_big_request(engine)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # two prompts forked into 16 choices: every seat taken
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert engine.scheduler.num_running_seqs == 16 and engine.scheduler.waiting
    engine.add_request("victim", prompt_of(20, 99), GREEDY)
    steps_to_first_token = 0
    while "victim" not in tokens:
        steps_to_first_token += 1
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert steps_to_first_token == 1
    run(engine, tokens)

    assert {k: v for k, v in tokens.items() if k != "victim"} == alone_tokens
    assert len(tokens["victim"]) == GREEDY.max_tokens
    for done in (alone, engine):
        done.check_integrity()
        assert done.block_manager.num_free_blocks == done.block_manager.num_blocks
        assert not done.sequences and not done.forks.parent_of
