"""Prefill in one engine, decode in another, KV blocks copied between their caches: the tokens
equal those of one colocated engine (greedy and seeded sampling), and both engines end with
every block back."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_node.prefill_engine import BlockWrite, PrefillEngine


def disaggregated_generate(
    prefill: LLMEngine, decode: LLMEngine, prompts, params_list, layers_per_write=None
):
    """Each write copies its blocks' layers the moment the prefill engine issues it (during
    the forward, with `layers_per_write` below the model's layer count)."""
    writes = []
    prefill_engine = PrefillEngine(prefill, layers_per_write)
    targets = {}
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        request_id = f"r{index}"
        targets[request_id] = decode.reserve_blocks(len(prompt))
        prefill_engine.add(request_id, prompt, params, targets[request_id])
    outputs: dict[str, list[int]] = {}

    def copy(write: BlockWrite) -> None:
        if write.layer_start == 0:
            writes.append((write.request_id, len(write.src_block_ids)))
        src, dst = write.src_block_ids, write.dst_block_ids
        layers = slice(write.layer_start, write.layer_end)
        decode.runner.kv_cache.buffer[layers, :, dst] = prefill.runner.kv_cache.buffer[
            layers, :, src
        ]

    while prefill_engine.has_work():
        step = prefill_engine.step(copy)
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


GREEDY = SamplingParams(temperature=0, max_tokens=20, min_tokens=20)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, min_tokens=20)


@pytest.mark.parametrize(
    ("params", "layers_per_write"),
    [(GREEDY, None), (SEEDED, None), (GREEDY, 1)],
    ids=["greedy", "seeded", "greedy-per-layer"],
)
def test_disaggregated_tokens_equal_colocated_tokens(
    tiny_llama_dir, prompts, params, layers_per_write
):
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
    tokens, writes = disaggregated_generate(
        prefill, decode, prompts, params_list, layers_per_write
    )
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


def test_a_one_chunk_prompt_writes_its_first_layers_before_its_forward_ends(tiny_llama_dir):
    """Layer-group streaming: the prompt fits one chunk, yet its blocks leave layer by layer,
    the first write before the model's last layer has run (a forward hook marks that)."""
    prefill = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    num_layers = prefill.model_config.num_layers
    events = []
    last_layer = prefill.runner.model.layers[-1]
    hook = last_layer.register_forward_hook(lambda *_: events.append("last layer computed"))
    prefill_engine = PrefillEngine(prefill, layers_per_write=1)
    prefill_engine.add("one", list(range(3, 43)), SamplingParams(max_tokens=1), [7, 8, 9])
    try:
        step = prefill_engine.step(
            lambda w: events.append((w.src_block_ids, w.dst_block_ids, w.layer_start,
                                     w.layer_end))
        )
    finally:
        hook.remove()
    assert len(step.first_tokens) == 1 and not step.writes
    writes = [e for e in events if e != "last layer computed"]
    assert [w[2:] for w in writes] == [(i, i + 1) for i in range(num_layers)]
    assert all(w[1] == [7, 8, 9] and w[0] == writes[0][0] for w in writes)
    assert events.index("last layer computed") == num_layers - 1  # after every earlier group
    prefill_engine.release("one")
    check_clean(prefill)
