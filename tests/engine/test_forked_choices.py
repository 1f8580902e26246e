"""n choices of one prompt (engine/forks.py): the prompt is computed once and forked, and each
choice's tokens equal those of a lone request with its own settings (seed + i), greedy and
seeded, under KV pressure too; copy-on-write copies of the shared partial block happen and are
counted; aborting one choice, or all, or the prompt, leaves every block free."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.llm_engine import LLMEngine

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=1234)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def choices_of(params: SamplingParams, n: int, prefix: str = "c") -> list[tuple[str, SamplingParams]]:
    seed = params.seed
    return [
        (f"{prefix}{i}", dataclasses.replace(params, seed=None if seed is None else seed + i))
        for i in range(n)
    ]


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def lone_tokens(engine: LLMEngine, prompt: list[int], choices) -> dict[str, list[int]]:
    for choice_id, params in choices:
        engine.add_request(choice_id, prompt, params)
    return run(engine)


def assert_all_free(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.sequences and not engine.forks.parent_of


@pytest.fixture
def engine(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    yield engine
    assert_all_free(engine)


@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["seeded", "greedy"])
def test_choices_equal_lone_requests_with_seed_plus_i(engine, params):
    prompt = prompt_of(37)  # 2 full blocks and a partial one, shared by the 4 choices
    choices = choices_of(params, 4)
    expected = lone_tokens(engine, prompt, choices)
    engine.block_manager.prefix_cache.evict(engine.block_manager.num_cached_blocks)
    computed = engine.num_prompt_tokens_computed

    engine.add_request("prompt", prompt, choices[0][1], choices=choices)
    assert run(engine) == expected
    assert engine.num_prompt_tokens_computed - computed == len(prompt)


def test_the_shared_partial_block_is_copied_on_write_and_counted(engine):
    choices = choices_of(GREEDY, 4)
    engine.add_request("prompt", prompt_of(37, seed=1), GREEDY, choices=choices)
    engine.step()  # the prompt (budget permitting) and the four first tokens
    assert set(engine.sequences) == {c for c, _ in choices}
    partial = engine.sequences["c0"].block_table[2]
    assert engine.block_manager.ref_counts[partial] == 4
    assert engine.block_manager.num_copied_blocks == 0
    engine.step()  # each choice appends into the partial block: three copies, one in place
    assert engine.block_manager.num_copied_blocks == 3
    tables = [engine.sequences[c].block_table for c, _ in choices]
    assert len({table[2] for table in tables}) == 4
    assert len({tuple(table[:2]) for table in tables}) == 1  # full blocks still shared
    engine.check_integrity()
    run(engine)


def test_a_prompt_of_whole_blocks_forks_without_copies(engine):
    engine.add_request("prompt", prompt_of(32, seed=2), GREEDY, choices=choices_of(GREEDY, 3))
    run(engine)
    assert engine.block_manager.num_copied_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_choices_resume_with_identical_tokens(tiny_llama_dir, mode):
    params = dataclasses.replace(SEEDED, max_tokens=40, min_tokens=40)
    prompts = [prompt_of(29, seed=s) for s in range(3)]
    reference = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)
    )
    expected: dict[str, list[int]] = {}
    for p, prompt in enumerate(prompts):
        expected |= lone_tokens(reference, prompt, choices_of(params, 3, f"p{p}c"))
    assert reference.scheduler.num_preemptions == 0

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, preemption_mode=mode,
            max_num_batched_tokens=64,
        )
    )
    for p, prompt in enumerate(prompts):
        engine.add_request(f"p{p}", prompt, params, choices=choices_of(params, 3, f"p{p}c"))
    assert run(engine) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def test_aborting_one_choice_leaves_the_others_going(engine):
    prompt = prompt_of(21, seed=3)
    choices = choices_of(SEEDED, 3)
    expected = lone_tokens(engine, prompt, choices)
    engine.add_request("prompt", prompt, SEEDED, choices=choices)
    got: dict[str, list[int]] = {}
    for _ in range(3):
        for output in engine.step().outputs:
            got.setdefault(output.request_id, []).extend(output.new_token_ids)
    engine.abort_request("c1")
    engine.check_integrity()
    for choice_id, tokens in run(engine).items():
        got[choice_id] += tokens
    assert got["c0"] == expected["c0"] and got["c2"] == expected["c2"]
    assert got["c1"] == expected["c1"][: len(got["c1"])] and len(got["c1"]) < 12


def test_aborting_choices_before_the_fork_and_the_prompt_itself(engine):
    prompt = prompt_of(50, seed=4)
    choices = choices_of(SEEDED, 3)
    expected = lone_tokens(engine, prompt, choices[1:2])
    engine.add_request("prompt", prompt, SEEDED, choices=choices)
    engine.abort_request("c0")
    engine.abort_request("c2")
    assert run(engine) == expected  # the last choice forks alone

    engine.add_request("prompt", prompt, SEEDED, choices=choices)
    engine.abort_request("c0")
    engine.abort_request("c1")
    engine.abort_request("c2")  # the last one ends the prompt
    assert not engine.has_unfinished_requests()

    engine.add_request("prompt", prompt, SEEDED, choices=choices)
    engine.abort_request("prompt")  # the request's own id ends every choice not forked yet
    assert run(engine) == {}


def test_a_choice_finishing_early_frees_its_blocks_alone(engine):
    prompt = prompt_of(40, seed=5)
    choices = choices_of(GREEDY, 3)
    choices[1] = ("c1", dataclasses.replace(GREEDY, max_tokens=1))
    choices[2] = ("c2", dataclasses.replace(GREEDY, max_tokens=3))
    expected = lone_tokens(engine, prompt, choices)
    engine.add_request("prompt", prompt, GREEDY, choices=choices)
    assert run(engine) == expected
    assert [len(expected[c]) for c, _ in choices] == [12, 1, 3]


def test_choices_count_against_max_num_seqs(tiny_llama_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    )
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("big", prompt_of(9), GREEDY, choices=choices_of(GREEDY, 5))
    engine.add_request("a", prompt_of(9), GREEDY, choices=choices_of(GREEDY, 3, "a"))
    engine.add_request("b", prompt_of(9, seed=1), GREEDY, choices=choices_of(GREEDY, 2, "b"))
    engine.step()
    assert engine.scheduler.num_running_seqs == 3  # "b" waits: 3 + 2 > 4
    run(engine)
    assert_all_free(engine)


def test_bad_choices_are_refused(engine):
    with pytest.raises(ValueError, match="distinct"):
        engine.add_request("p", prompt_of(9), GREEDY, choices=[("c", GREEDY), ("c", GREEDY)])
    engine.add_request("c0", prompt_of(9), GREEDY)
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("p", prompt_of(9), GREEDY, choices=choices_of(GREEDY, 2))
    run(engine)
