"""Tensor parallelism (engine/distributed/): greedy tokens with two ranks equal one rank's.

Every supported family, in fp32, on tiny random-weight models; the llama3-rope-tied model has
one KV head for two ranks (replicated KV, and a tied, vocabulary-parallel head). Chunked
prefill, copy-on-write of shared prefix blocks and preemption by recompute and by swap run on
two ranks too. Each TP engine starts one worker process, which the tests stop (`close`) and
check gone; a worker that dies makes the engine raise, naming it.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.distributed.group import RankFailure
from pdserve.engine.kv.shared_segment import SHM_DIR
from pdserve.testing.tiny_models import save_tiny_model, tiny_configs
from tests.engine.test_preemption_modes import pressure_prompts

PROMPT_LENGTHS = (3, 17, 40, 1, 70)
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def greedy_tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    return [o.token_ids for o in outputs]


def close_and_check_stopped(llm: LLM) -> None:
    workers = llm.engine.runner.workers
    node_cache = llm.engine.runner.node_kv_cache  # every rank's shard, in shared memory
    llm.close()
    assert workers is not None
    assert all(process.poll() is not None for process in workers.processes)
    assert not (SHM_DIR / node_cache.name).exists()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return {kind: str(save_tiny_model(kind, root / kind)) for kind in tiny_configs()}


@pytest.mark.parametrize("kind", sorted(tiny_configs()))
def test_two_ranks_give_the_greedy_tokens_of_one(model_dirs, kind):
    prompts = make_prompts()
    expected = greedy_tokens(LLM(model_dirs[kind], dtype="float32", num_kv_blocks=64), prompts)
    llm = LLM(model_dirs[kind], dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        layout = llm.engine.runner.layout
        kv_heads = tiny_configs()[kind].num_key_value_heads
        assert (layout.num_heads, layout.num_kv_heads) == (2, max(1, kv_heads // 2))
        assert layout.kv_replicated == (kv_heads < 2)
        assert greedy_tokens(llm, prompts) == expected
    finally:
        close_and_check_stopped(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_and_preemption_keep_the_tokens_on_two_ranks(model_dirs, mode):
    model = model_dirs["llama3-rope-tied"]
    prompts = pressure_prompts(pairs=3)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    expected = greedy_tokens(
        LLM(model, dtype="float32", enable_prefix_caching=False), prompts, params
    )
    llm = LLM(
        model,
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=12,
        max_num_batched_tokens=24,
        preemption_mode=mode,
        prefix_cache_min_blocks=1,
    )
    try:
        assert greedy_tokens(llm, prompts, params) == expected
        assert llm.engine.scheduler.num_preemptions_by_mode[mode] > 0
        if mode == "swap":
            assert llm.engine.swap_space.bytes_out_total > 0
    finally:
        close_and_check_stopped(llm)


def test_a_dead_worker_makes_the_engine_raise_naming_it(model_dirs):
    llm = LLM(model_dirs["llama"], dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    process = llm.engine.runner.workers.processes[0]
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    try:
        with pytest.raises(RankFailure, match=r"tensor-parallel rank 1 .*exited with code -9"):
            llm.generate(make_prompts((5,)), GREEDY)
    finally:
        llm.close()


def test_a_model_the_ranks_cannot_split_is_refused_before_any_process_starts(model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4"):
        LLM(model_dirs["llama"], dtype="float32", tensor_parallel_size=3)


def run_choices(llm: LLM, prompt: list[int], params: SamplingParams) -> dict[str, list]:
    """A prompt forked into two greedy choices (copy-on-write of its last block); each
    choice's (token, logprob) pairs and the prompt's scores."""
    engine = llm.engine
    engine.add_request("prompt", prompt, params, choices=[("a", params), ("b", params)])
    results: dict[str, list] = {"a": [], "b": [], "scores": []}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            results[output.request_id] += [(s.token_id, s.logprob) for s in output.new_logprobs]
            if output.prompt_logprobs:
                results["scores"] = [(s.token_id, s.logprob) for s in output.prompt_logprobs]
    engine.check_integrity()
    return results


def test_logprobs_prompt_scores_and_forked_choices_match_one_rank(model_dirs):
    model = model_dirs["qwen2"]
    prompt = make_prompts((21,))[0]
    params = SamplingParams(
        temperature=0, max_tokens=8, min_tokens=8, logprobs=2, prompt_logprobs=1
    )
    expected = run_choices(LLM(model, dtype="float32", num_kv_blocks=32), prompt, params)
    llm = LLM(model, dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        got = run_choices(llm, prompt, params)
        assert llm.engine.block_manager.num_copied_blocks > 0
    finally:
        close_and_check_stopped(llm)
    for key in ("a", "b", "scores"):
        assert [t for t, _ in got[key]] == [t for t, _ in expected[key]]
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in expected[key]], abs=1e-4)
    assert len(expected["scores"]) == len(prompt) - 1
