"""Quantized linears in the engine: int8 (`quantization="int8"`, engine/layers/int8_weight.py:
weight-only, one scale per output row) and int4 (`"int4"`, engine/layers/int4_weight.py: a
scale and minimum per row and 32 inputs, inputs rounded to int8 inside each linear).

- The option takes "int8" and "int4" only (anything else is refused naming the field and the
  choices); every linear, the head included, is quantized, and a decode step reads about a
  quarter (int8) or 5/32 (int4) of the fp32 engine's weight bytes.
- Accuracy, stated as bounds on the logprobs of the fp32 engine's greedy tokens under the
  quantized weights (tests/engine/prompt_scoring.py): scored as prompts (whole, and 32 tokens
  at a time through the cache), and at decode steps while the quantized engine's tokens still
  follow the fp32 ones. Measured with 8 prompts of 1-300 tokens, 32 greedy tokens:
    int8 (2-core AMD EPYC): tiny random models (testing/tiny_models.py) max |delta logprob|
    0.35 (llama, mistral), 0.27 (llama3-rope-tied), 0.25 (qwen2), 0.22 (qwen3) nats as
    prompts, 0.14-0.28 at decode steps, bound 0.75; SmolLM2-135M-Instruct (the default model,
    8 English prompts) 0.36 nats as prompts, 0.31 at decode steps, bound 0.6.
    int4 (2-core Intel Xeon, fp16 scales and minimums): tiny random models 5.62 (llama,
    mistral), 4.77 (llama3-rope-tied), 5.09 (qwen2), 2.45 (qwen3) nats as prompts, bound 7
    (weights of std 0.25 with no structure are the worst case for 16 levels a group; there the
    fp32 token can fall far down the int4 engine's ranks at a decode step, so decode steps are
    not scored on them); the default model 0.94 nats as prompts, 1.01 at decode steps, bound 2
    (1.33 and 1.07 with the bf16 scales and minimums of before: its weights now come back
    exactly, below, and only the inputs' rounding to int8 moves a logprob).
  Whole and chunked scoring agree to float noise under int8. Under int4 they differ by up to
  0.09 nats on the tiny models (bound 0.15): the attention's sums round in another order when
  chunked, and an input a hair from a rounding boundary then rounds to the other int8 value.
- The default model ships as Q4_1 (an fp16 scale and minimum per 32 inputs), so its fp32
  weights are 4-bit values already: int4, whose scales and minimums are fp16 too, gives every
  decoder weight back exactly (the file's own 4-bit values), where weights of no such structure
  would be up to half a step off.
- Nothing is leaked: every block is free after each engine's requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.int4_weight import Int4Weight
from pdserve.engine.layers.int8_weight import Int8Weight
from pdserve.engine.layers.linear import Linear
from pdserve.testing.tiny_models import save_tiny_model, tiny_configs
from tests.engine.prompt_scoring import greedy_logprob_differences
from tests.engine.test_fp8_kv_cache import DEFAULT_MODEL_PROMPTS
from tests.engine.test_greedy_parity import make_prompts


@dataclass(frozen=True)
class Expected:
    form: type
    bytes_ratio: tuple[float, float]  # of the fp32 engine's decode bytes: [low, high)
    tiny_bound: float  # nats
    default_model_bound: float  # nats
    chunking_difference: float  # nats between whole and chunked scoring
    tiny_decode_scored: bool


EXPECTED = {
    "int8": Expected(Int8Weight, (0.25, 0.3), 0.75, 0.6, 1e-4, True),
    "int4": Expected(Int4Weight, (5 / 32, 0.2), 7.0, 2.0, 0.15, False),
}


def test_the_option_takes_int8_and_int4_only():
    for name in EXPECTED:
        assert EngineConfig(quantization=name).quantization == name
    assert EngineConfig().quantization is None
    for wrong in ("int2", "awq", "fp8", "rtn", ""):
        with pytest.raises(
            ValueError, match=r"quantization must be one of \('int8', 'int4'\)"
        ):
            EngineConfig(quantization=wrong)


@pytest.mark.parametrize("quantization", sorted(EXPECTED))
def test_every_linear_is_quantized_and_a_decode_step_reads_fewer_bytes(
    quantization, tiny_llama_dir
):
    expected = EXPECTED[quantization]
    full = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=4).engine.runner.model
    quantized = LLM(
        str(tiny_llama_dir), dtype="float32", quantization=quantization, num_kv_blocks=4
    ).engine.runner.model
    linears = [m for m in quantized.modules() if isinstance(m, Linear)]
    assert quantized.lm_head in linears
    assert all(isinstance(m.quantized, expected.form) and m.weight is None for m in linears)
    ratio = quantized.decode_weight_bytes() / full.decode_weight_bytes()
    low, high = expected.bytes_ratio
    assert low <= ratio < high, ratio  # the weights, their scales; fp32 biases and norms


@pytest.mark.parametrize("quantization", sorted(EXPECTED))
@pytest.mark.parametrize("family", sorted(tiny_configs()))
def test_logprobs_of_the_fp32_greedy_tokens_stay_within_the_bound(
    family, quantization, tmp_path
):
    expected = EXPECTED[quantization]
    model_dir = str(save_tiny_model(family, tmp_path))
    worst = greedy_logprob_differences(
        model_dir, make_prompts(), decode=expected.tiny_decode_scored, quantization=quantization
    )
    assert max(worst.values()) <= expected.tiny_bound, worst
    assert worst["whole"] > 1e-3, "the weights changed nothing: are they quantized?"
    assert worst["chunked"] == pytest.approx(worst["whole"], abs=expected.chunking_difference)


@pytest.mark.default_model
@pytest.mark.parametrize("quantization", sorted(EXPECTED))
def test_logprobs_on_the_default_model_stay_within_the_bound(quantization, default_model_dir):
    model_dir = str(default_model_dir)
    tokenizer = LLM(model_dir, dtype="float32", num_kv_blocks=1).tokenizer
    prompts = [tokenizer.encode(text) for text in DEFAULT_MODEL_PROMPTS]
    worst = greedy_logprob_differences(model_dir, prompts, quantization=quantization)
    assert max(worst.values()) <= EXPECTED[quantization].default_model_bound, worst
    assert worst["whole"] > 1e-3, worst


@pytest.mark.default_model
def test_int4_gives_back_the_default_models_shipped_4_bit_weights_exactly(default_model_dir):
    from safetensors.torch import load_file

    from pdserve.kernels.cpu_int4_linear import GROUP, dequantize, quantize

    weights = {}
    for path in sorted(default_model_dir.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    linears = {
        name: weight.float()
        for name, weight in weights.items()
        if weight.dim() == 2 and "embed" not in name
    }
    assert len(linears) >= 7 * 30, sorted(linears)  # q, k, v, o, gate, up, down per layer
    for name, weight in linears.items():
        q, scale, minimum = quantize(weight)
        back = dequantize(q, scale, minimum)
        step = scale.repeat_interleave(GROUP, dim=1)[:, : weight.shape[1]]
        off = float(((back - weight).abs() / step.clamp_min(1e-30)).max())
        assert torch.equal(back, weight), f"{name}: a weight {off:.3g} of a step from the file's"
