"""FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`, vLLM's semantics: stored = fp8(x / scale), read =
float(stored) x scale, per-layer scales) in the engine.

- The option takes "auto", "fp8_e4m3" and vLLM's alias "fp8"; anything else is refused naming
  the value and the choices. The same KV memory holds 2x the blocks of a bf16 cache and 4x an
  fp32 one.
- Scales come from the checkpoint under every name vLLM reads (else 1.0), and the loader does
  not take them for weights; layer 0's keys and values (computed from the embeddings alone,
  so bit-identical in both engines) are stored as exactly quantize(x / scale).
- Accuracy, stated as bounds on the logprobs of the model-dtype (fp32) cache's greedy tokens
  under the fp8 cache: scored as prompts (whole, and 32 tokens at a time through the cache),
  and at decode steps while the fp8 tokens still follow them. The fp8 cache's attention reads
  what the cache holds even for a chunk without context (its fresh keys go through the fp8
  round trip), so whole and chunked scoring agree to float noise; that is also what makes
  disaggregated fp8 serving equal colocated fp8 serving token for token
  (tests/nodes/test_fp8_disaggregated_nodes.py).
  Measured (2-core Xeon, scales 1.0, 8 prompts of 1-300 tokens, 32 greedy tokens):
    tiny random models (testing/tiny_models.py, wide initializer, harsh on narrow caches, as in
    test_bf16_cpu.py): max |delta logprob| 1.38 (llama, mistral), 1.56 (llama3-rope-tied),
    1.20 (qwen2), 0.39 (qwen3) nats as prompts (chunked equal to whole within 2e-6), 0.28-1.56
    at decode steps; bound TINY_LOGPROB_BOUND = 2.5 nats.
    SmolLM2-135M-Instruct (the default model, fp32, 8 English prompts): 0.44 nats as prompts,
    0.32 at decode steps, 2 of 8 sequences identical for all 32 tokens; bound
    DEFAULT_MODEL_LOGPROB_BOUND = 0.75 nats.
- Copy-on-write (n choices), swap preemption and prefix-cache hits keep fp8 tokens identical;
  block moves carry fp8 blocks as bytes.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.block_moves import BlockStaging, copy_blocks, gather_blocks, scatter_blocks
from pdserve.engine.kv.kv_scales import KVScales, is_kv_scale_name, quantize
from pdserve.engine.llm_engine import LLMEngine
from pdserve.testing.tiny_models import save_tiny_model, tiny_configs
from tests.engine.prompt_scoring import greedy_logprob_differences
from tests.engine.test_forked_choices import choices_of, lone_tokens, prompt_of, run
from tests.engine.test_greedy_parity import make_prompts
from tests.engine.test_preemption_modes import check_everything_returned, pressure_prompts

FP8 = torch.float8_e4m3fn
TINY_LOGPROB_BOUND = 2.5
DEFAULT_MODEL_LOGPROB_BOUND = 0.75
DEFAULT_MODEL_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
    "In 1969, the first humans",
    "To make a cup of tea, first",
    "The quick brown fox",
)


def assert_all_free(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_the_option_takes_auto_fp8_e4m3_and_vllms_alias():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    config = EngineConfig(kv_cache_dtype="fp8_e4m3")
    assert config.resolve_kv_cache_dtype(torch.bfloat16) == FP8
    assert EngineConfig().resolve_kv_cache_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp8_e4m3'.*'int8'"):
        EngineConfig(kv_cache_dtype="int8")


def test_the_same_kv_memory_holds_2x_the_bf16_blocks_and_4x_the_fp32_blocks(tiny_llama_dir):
    def blocks(dtype: str, kv_cache_dtype: str) -> int:
        llm = LLM(
            str(tiny_llama_dir),
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=4 << 20,
        )
        cache = llm.engine.runner.kv_cache
        assert llm.engine.block_manager.num_blocks == cache.num_blocks
        assert cache.buffer.numel() * cache.buffer.element_size() <= 4 << 20
        return cache.num_blocks

    fp8 = blocks("float32", "fp8")
    assert fp8 == blocks("bfloat16", "fp8_e4m3")  # the weights' dtype does not matter
    assert fp8 == 2 * blocks("bfloat16", "auto") == 4 * blocks("float32", "auto")


def test_scales_are_read_under_every_name_vllm_reads_and_default_to_one():
    named = [
        ("model.layers.0.self_attn.k_scale", torch.tensor(2.0)),
        ("model.layers.0.self_attn.v_proj.output_scale", torch.tensor([0.25])),
        ("model.layers.1.self_attn.kv_scale", torch.tensor(3.0, dtype=torch.bfloat16)),
        ("model.layers.2.self_attn.attn.v_scale", torch.tensor(0.5)),
        ("model.layers.2.self_attn.k_proj.output_scale", torch.tensor(4.0)),
        ("model.layers.2.self_attn.k_proj.weight", torch.ones(2, 2)),  # a weight: skipped
    ]
    scales = KVScales.from_tensors(named, num_layers=4)
    assert scales.k == (2.0, 3.0, 4.0, 1.0) and scales.v == (0.25, 3.0, 0.5, 1.0)
    assert "checkpoint (5 scale tensors)" == scales.source
    assert KVScales.from_tensors(named[-1:], 4) == KVScales.ones(4)
    assert not is_kv_scale_name("model.layers.2.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="only per-tensor scales"):
        KVScales.from_tensors([("model.layers.0.self_attn.k_scale", torch.ones(4))], 2)
    with pytest.raises(ValueError, match="names layer 5; the model has 2"):
        KVScales.from_tensors([("model.layers.5.self_attn.k_scale", torch.tensor(1.0))], 2)
    with pytest.raises(ValueError, match="positive and finite"):
        KVScales((0.0,), (1.0,))


def test_an_engine_takes_its_checkpoints_scales_and_stores_x_over_scale(tiny_llama_dir, tmp_path):
    scaled_dir = tmp_path / "with-scales"
    shutil.copytree(tiny_llama_dir, scaled_dir)
    save_file(
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(2.0),
            "model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.25),
            "model.layers.1.self_attn.kv_scale": torch.tensor(3.0),
        },
        scaled_dir / "kv_scales.safetensors",
    )
    prompt = prompt_of(37)
    once = SamplingParams(temperature=0, max_tokens=1)  # only the prompt is written
    fp8 = LLM(str(scaled_dir), dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=8)
    full = LLM(str(scaled_dir), dtype="float32", num_kv_blocks=8)
    assert fp8.engine.runner.kv_scales.k == (2.0, 3.0)
    assert fp8.engine.runner.kv_scales.v == (0.25, 3.0)
    assert full.engine.runner.kv_scales == KVScales.ones(2)  # a model-dtype cache: unused
    fp8.generate([prompt], once)
    full.generate([prompt], once)
    assert_all_free(fp8)
    assert_all_free(full)

    stored = fp8.engine.runner.kv_cache.buffer[0]
    exact = full.engine.runner.kv_cache.buffer[0]
    for kv, scale in ((0, 2.0), (1, 0.25)):
        expected = quantize(exact[kv], FP8, scale)
        assert torch.equal(stored[kv].view(torch.uint8), expected.view(torch.uint8))
        assert not torch.equal(
            expected.view(torch.uint8), quantize(exact[kv], FP8, 1.0).view(torch.uint8)
        ), "the scale must change what is stored"


@pytest.mark.parametrize("family", sorted(tiny_configs()))
def test_fp8_logprobs_of_the_fp32_greedy_tokens_stay_within_the_bound(family, tmp_path):
    model_dir = str(save_tiny_model(family, tmp_path))
    worst = greedy_logprob_differences(model_dir, make_prompts(), kv_cache_dtype="fp8")
    assert max(worst.values()) <= TINY_LOGPROB_BOUND, worst
    assert worst["whole"] > 1e-3, "the fp8 cache changed nothing: is it quantizing?"
    assert worst["chunked"] == pytest.approx(worst["whole"], abs=1e-4), worst


@pytest.mark.default_model
def test_fp8_logprobs_on_the_default_model_stay_within_the_bound(default_model_dir):
    model_dir = str(default_model_dir)
    tokenizer = LLM(model_dir, dtype="float32", num_kv_blocks=1).tokenizer
    prompts = [tokenizer.encode(text) for text in DEFAULT_MODEL_PROMPTS]
    worst = greedy_logprob_differences(model_dir, prompts, kv_cache_dtype="fp8")
    assert max(worst.values()) <= DEFAULT_MODEL_LOGPROB_BOUND, worst
    assert worst["whole"] > 1e-3, worst


def test_fp8_swap_preemption_keeps_the_tokens_and_returns_every_block(tiny_llama_dir):
    greedy = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    reference = LLM(
        str(tiny_llama_dir), dtype="float32", kv_cache_dtype="fp8", enable_prefix_caching=False
    )
    expected = [o.token_ids for o in reference.generate(pressure_prompts(), greedy)]
    assert reference.engine.scheduler.num_preemptions == 0
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        kv_cache_dtype="fp8",
        num_kv_blocks=14,
        preemption_mode="swap",
        enable_prefix_caching=False,
    )
    assert [o.token_ids for o in llm.generate(pressure_prompts(), greedy)] == expected
    assert llm.engine.scheduler.num_preemptions_by_mode["swap"] > 0
    assert llm.engine.swap_space.bytes_out_total > 0
    check_everything_returned(llm)


def test_fp8_choices_copy_the_shared_block_on_write_and_equal_lone_requests(tiny_llama_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64
        )
    )
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=1234)
    for params in (greedy, seeded):
        prompt = prompt_of(37)  # 2 full blocks and a partial one, shared by the choices
        choices = choices_of(params, 4)
        expected = lone_tokens(engine, prompt, choices)
        engine.block_manager.prefix_cache.evict(engine.block_manager.num_cached_blocks)
        copied = engine.block_manager.num_copied_blocks
        engine.add_request("prompt", prompt, dataclasses.replace(params), choices=choices)
        assert run(engine) == expected
        assert engine.block_manager.num_copied_blocks - copied == 3
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_fp8_prefix_cache_hits_give_the_tokens_of_a_cold_prefill(tiny_llama_dir):
    """A prompt that reuses cached fp8 blocks attends the same stored values a cold prefill of
    it would (a chunk without context goes through the fp8 round trip too)."""
    greedy = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    prompts = pressure_prompts()  # pairs share a 40-token prefix
    cold = LLM(
        str(tiny_llama_dir), dtype="float32", kv_cache_dtype="fp8", enable_prefix_caching=False
    )
    expected = [cold.generate([p], greedy)[0].token_ids for p in prompts]
    warm = LLM(
        str(tiny_llama_dir), dtype="float32", kv_cache_dtype="fp8", prefix_cache_min_blocks=1
    )
    assert [warm.generate([p], greedy)[0].token_ids for p in prompts] == expected
    assert warm.engine.block_manager.prefix_cache.stats.hits >= 4 * 32
    assert_all_free(warm)
    assert_all_free(cold)


def test_block_moves_carry_fp8_blocks_as_bytes():
    """torch has no index_copy_ for fp8 on the CPU: every block move goes through bytes."""
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randn(2, 2, 6, 2, 4, 8, generator=generator).to(FP8)
    before = buffer.view(torch.uint8).clone()
    copy_blocks(buffer, [(1, 4), (2, 5)])
    assert torch.equal(buffer.view(torch.uint8)[:, :, 4:6], before[:, :, 1:3])
    ids = torch.tensor([3, 0])
    gathered = gather_blocks(buffer, ids)
    assert gathered.dtype == FP8
    assert torch.equal(gathered.view(torch.uint8), before[:, :, [3, 0]])
    host = torch.zeros(2, 2, 3, 2, 4, 8, dtype=FP8)
    BlockStaging(max_batch_bytes=1).copy(host, [2, 0], buffer, [3, 1])  # a block per batch
    assert torch.equal(host.view(torch.uint8)[:, :, [2, 0]], before[:, :, [3, 1]])
    scatter_blocks(buffer, torch.tensor([1]), host[:, :, 2:3])
    assert torch.equal(buffer.view(torch.uint8)[:, :, 1], before[:, :, 3])
