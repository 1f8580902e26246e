"""Greedy tokens from the engine equal transformers' greedy generate, token for token.

Eight prompts of 1 to 300 tokens, 48 new tokens each, for every supported family; and again
under chunked prefill (mixed steps), preemption by recompute, and other block sizes, on two
families whose KV layouts differ most (one KV head with tied, llama3-scaled rope; Qwen3's
q/k norms with a head size of its own): those variants exercise the scheduler and the paged
cache, which do not depend on the family, so repeating them on all five bought no coverage.

Every engine here runs in fp32, whatever `dtype="auto"` picks on this CPU: fp32 is the
token-exact gate. bf16 is held to bounds instead (tests/engine/test_bf16_cpu.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine import LLM, SamplingParams
from pdserve.testing.tiny_models import save_tiny_model, tiny_configs

PROMPT_LENGTHS = (3, 17, 40, 300, 16, 1, 100, 77)
NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
# Every prompt with its new tokens at once takes 63 blocks of 16. Sized by the device's memory
# instead, a tiny model's cache on a large GPU is millions of blocks to book-keep.
CUDA_KV_BLOCKS = 128


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference_greedy(model_dir, prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


FAMILIES = sorted(tiny_configs())
VARIANT_FAMILIES = ("llama3-rope-tied", "qwen3")


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """(model folder, prompts, transformers' greedy tokens) of the family in request.param."""
    model_dir = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = make_prompts()
    return str(model_dir), prompts, reference_greedy(model_dir, prompts)


def generate_and_check_clean(llm: LLM, prompts, params=GREEDY):
    outputs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_greedy_equals_transformers(family):
    model_dir, prompts, expected = family
    assert generate_and_check_clean(LLM(model_dir, dtype="float32"), prompts) == expected


@pytest.mark.parametrize("family", VARIANT_FAMILIES, indirect=True)
def test_chunked_prefill_and_mixed_steps_keep_greedy_tokens(family):
    model_dir, prompts, expected = family
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=32)
    assert generate_and_check_clean(llm, prompts) == expected


@pytest.mark.parametrize("family", VARIANT_FAMILIES, indirect=True)
def test_preempted_requests_resume_with_identical_tokens(family):
    model_dir, prompts, expected = family
    longest_blocks = -(-(max(PROMPT_LENGTHS) + NEW_TOKENS) // 16)
    llm = LLM(
        model_dir, dtype="float32", num_kv_blocks=longest_blocks + 4, max_num_batched_tokens=64
    )
    assert generate_and_check_clean(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", VARIANT_FAMILIES, indirect=True)
@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_keep_greedy_tokens(family, block_size):
    model_dir, prompts, expected = family
    llm = LLM(model_dir, dtype="float32", block_size=block_size, max_num_batched_tokens=48)
    assert generate_and_check_clean(llm, prompts) == expected


@pytest.mark.parametrize("family", VARIANT_FAMILIES, indirect=True)
def test_prompts_as_text_match_their_token_ids(family):
    model_dir, _, _ = family
    llm = LLM(model_dir, dtype="float32")
    text = "héllo wörld, the quick brown fox"
    by_text = llm.generate([text], SamplingParams(temperature=0, max_tokens=8))[0]
    by_ids = llm.generate([llm.tokenizer.encode(text)], SamplingParams(temperature=0, max_tokens=8))
    assert by_text.prompt_token_ids == by_ids[0].prompt_token_ids
    assert by_text.token_ids == by_ids[0].token_ids
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_greedy_equals_transformers_on_cuda_in_fp32(family):
    model_dir, prompts, expected = family
    llm = LLM(
        model_dir, device="cuda", dtype="float32", max_num_batched_tokens=64,
        num_kv_blocks=CUDA_KV_BLOCKS,
    )
    assert generate_and_check_clean(llm, prompts) == expected
