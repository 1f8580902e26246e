"""Prefill in one engine, decode in another, KV blocks copied between their caches: the tokens
equal those of one colocated engine (greedy and seeded sampling), and both engines end with
every block back."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_node.prefill_engine import PrefillEngine


def disaggregated_generate(prefill: LLMEngine, decode: LLMEngine, prompts, params_list):
    writes = []
    prefill_engine = PrefillEngine(prefill)
    targets = {}
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        request_id = f"r{index}"
        targets[request_id] = decode.reserve_blocks(len(prompt))
        prefill_engine.add(request_id, prompt, params, targets[request_id])
    outputs: dict[str, list[int]] = {}
    while prefill_engine.has_work():
        step = prefill_engine.step()
        for write in step.writes:
            writes.append((write.request_id, len(write.src_block_ids)))
            src, dst = write.src_block_ids, write.dst_block_ids
            decode.runner.kv_cache.buffer[:, :, dst] = prefill.runner.kv_cache.buffer[:, :, src]
        for first in step.first_tokens:
            prefill_engine.release(first.request_id)
            index = int(first.request_id[1:])
            outputs[first.request_id] = [first.token_id]
            finished = decode.add_prefilled_request(
                first.request_id,
                prompts[index],
                params_list[index],
                targets[first.request_id],
                first.token_id,
            )
            assert finished is None
    while decode.has_unfinished_requests():
        for output in decode.step().outputs:
            outputs[output.request_id].extend(output.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))], writes


def check_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not engine.held_blocks


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    lengths = (1, 15, 16, 17, 33, 90, 200)
    return [shared[: n // 2] + [rng.randrange(3, 500) for _ in range(n - n // 2)] for n in lengths]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=20, min_tokens=20),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, min_tokens=20),
    ],
    ids=["greedy", "seeded"],
)
def test_disaggregated_tokens_equal_colocated_tokens(tiny_llama_dir, prompts, params):
    params_list = [
        SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else i})
        for i in range(len(prompts))
    ]
    colocated = LLM(str(tiny_llama_dir), dtype="float32")
    expected = [o.token_ids for o in colocated.generate(prompts, params_list)]
    prefill = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=48)
    )
    decode = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    tokens, writes = disaggregated_generate(prefill, decode, prompts, params_list)
    assert tokens == expected
    chunked = [rid for rid in {w[0] for w in writes} if sum(1 for w in writes if w[0] == rid) > 1]
    assert chunked, "no prompt was sent in more than one chunk"
    check_clean(prefill)
    check_clean(decode)


def test_reserved_blocks_return_when_released(tiny_llama_dir):
    decode = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    before = decode.block_manager.num_free_blocks
    reserved = decode.reserve_blocks(100)
    assert len(reserved) == 7 and decode.block_manager.num_free_blocks == before - 7
    decode.check_integrity()
    decode.release_blocks(reserved)
    check_clean(decode)


def test_a_preempted_disaggregated_request_recomputes_locally_with_identical_tokens(
    tiny_llama_dir, prompts
):
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    params_list = [params] * len(prompts)
    colocated = LLM(str(tiny_llama_dir), dtype="float32")
    expected = [o.token_ids for o in colocated.generate(prompts, params_list)]
    prefill = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    longest = -(-(max(len(p) for p in prompts) + 40) // 16)
    decode = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=longest + 8)
    )
    tokens, _ = disaggregated_generate(prefill, decode, prompts[:3] + prompts[-1:], params_list)
    assert tokens == expected[:3] + expected[-1:]
    assert decode.scheduler.num_preemptions > 0
    check_clean(prefill)
    check_clean(decode)


def test_each_chunk_of_a_long_prompt_reports_its_progress_beyond_the_cache(tiny_llama_dir):
    """The node tells the router how far a prompt is (wire PromptProgress): each step that
    computes a chunk without finishing the prompt names it with its tokens computed beyond
    the prefix-cache hit; the step that finishes it samples the first token instead."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=48)
    )
    rng = random.Random(9)
    prompt = [rng.randrange(3, 500) for _ in range(130)]
    for request_id, cached in (("cold", 0), ("warm", 16)):
        # the warm prompt shares its first 16 tokens (one block) with the cold one
        tokens = prompt if request_id == "cold" else prompt[:16] + prompt[::-1][16:]
        engine.add_request(request_id, tokens, SamplingParams(max_tokens=1))
        progress, outputs = [], []
        while engine.has_unfinished_requests():
            step = engine.step()
            progress += [step.prompt_progress[request_id]] if step.prompt_progress else []
            outputs += step.outputs
        assert progress == [48, 96]  # chunks of 48 after the cache hit
        assert [o.num_cached_tokens for o in outputs] == [cached]
    check_clean(engine)
