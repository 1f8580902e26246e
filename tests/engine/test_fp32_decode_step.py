"""The compiled one-sequence fp32 step, with int8, 4-bit and fp32 weights
(engine/runner/fp32_one_token_step.py, kernels/cpu_fp32_decode_step.py), on any CPU: from the
same cache state it writes the keys and values and gives the logits of the torch forward over
the same weights, to fp32 rounding (the order of sums; with 4-bit weights, see
INT4_TOLERANCES), with a sliding window shorter than the context too; the runner takes it
for one sequence decoding one token only, and greedy text equals the torch forward's (but for
4-bit weights on these random models); it is not
built where a part of it cannot run. tests/kernels/test_instruction_sets.py runs this file
again with numba compiling for AVX2."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.layers.linear import Fp32OneTokenWeight, Linear
from pdserve.engine.runner.fp32_one_token_step import Fp32OneTokenStep
from pdserve.testing.tiny_models import save_tiny_model
from tests.engine.test_compiled_decode import BLOCK_TABLE, PROMPT_LEN, torch_forward

pytest.importorskip("numba")

# 4-bit linears round their inputs to int8, so an fp32 rounding difference upstream (the norm's
# sum order) can move an input to the next int8 value and the output by a step: measured on the
# tiny llama, the step's logits differ from the torch forward's by 0.14 and its cache by 0.043,
# and nudging the token's embedding by 1e-6 moves the torch forward's own logits by 0.18.
INT4_TOLERANCES = {"logits": 0.5, "cache": 0.15}


@pytest.fixture(
    scope="module",
    params=[
        (model, quantization)
        for model in ("llama", "llama3-rope-tied", "mistral", "qwen2")
        for quantization in ("int8", "int4", None)
    ],
    ids=lambda param: f"{param[0]}-{param[1] or 'fp32'}",
)
def fp32_llm(request, tmp_path_factory):
    model, quantization = request.param
    folder = save_tiny_model(model, tmp_path_factory.mktemp(model))
    return LLM(str(folder), dtype="float32", quantization=quantization, kv_cache_memory=1 << 26)


def compare_one_step(runner, step: Fp32OneTokenStep, token: int) -> None:
    """Prefills a prompt, then decodes `token` both ways from the same cache state."""
    prompt = torch.randint(3, 250, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    torch_forward(runner, prompt.tolist(), 0)
    before = runner.kv_cache.buffer.clone()
    expected = torch_forward(runner, [token], PROMPT_LEN)
    expected_cache = runner.kv_cache.buffer.clone()
    runner.kv_cache.buffer.copy_(before)

    logits = step(torch.tensor([token]), BLOCK_TABLE, PROMPT_LEN + 1)

    assert logits.shape == expected.shape
    if runner.config.quantization == "int4":
        torch.testing.assert_close(logits, expected, atol=INT4_TOLERANCES["logits"], rtol=0)
        torch.testing.assert_close(
            runner.kv_cache.buffer, expected_cache, atol=INT4_TOLERANCES["cache"], rtol=0
        )
    else:
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(runner.kv_cache.buffer, expected_cache, atol=1e-5, rtol=1e-5)
    assert (runner.kv_cache.buffer != before).any(), "the step wrote no key or value"


def test_the_compiled_step_gives_the_torch_forwards_logits_and_cache(fp32_llm):
    runner = fp32_llm.engine.runner
    assert isinstance(runner.one_token_step, Fp32OneTokenStep)
    compare_one_step(runner, runner.one_token_step, token=77)


def test_the_compiled_step_reads_only_a_sliding_windows_keys(fp32_llm, monkeypatch):
    runner = fp32_llm.engine.runner
    window = 12  # of a 41-token context, across three blocks
    monkeypatch.setattr(runner.attention, "sliding_window", window)
    monkeypatch.setattr(runner.attention.cpu_decode, "sliding_window", window)
    step = Fp32OneTokenStep(runner.model, runner.kv_cache, runner.attention.scale, window)
    compare_one_step(runner, step, token=120)


def test_the_runner_takes_the_compiled_step_for_one_sequence_and_its_text_is_the_torch_forwards(
    fp32_llm, monkeypatch
):
    runner = fp32_llm.engine.runner
    path = runner.forward_path("one_token_step")
    step, calls = path.step, []
    monkeypatch.setattr(path, "step", lambda *args: calls.append(args) or step(*args))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    alone = fp32_llm.generate(prompts[:1], [params])[0].token_ids
    assert len(calls) == 11  # the prompt's step samples the first token; then eleven decodes
    calls.clear()
    together = fp32_llm.generate(prompts, [params] * 2)[0].token_ids
    assert len(calls) == 0  # two sequences decoding: the torch forward
    if fp32_llm.engine.config.quantization != "int4":  # its rounding flips: INT4_TOLERANCES
        assert list(alone) == list(together)
    fp32_llm.engine.check_integrity()


def test_no_compiled_fp32_step_where_a_part_cannot_run(tiny_llama_dir, tmp_path):
    fp8_cache = LLM(
        str(tiny_llama_dir), dtype="float32", quantization="int8", kv_cache_dtype="fp8",
        kv_cache_memory=1 << 26,
    ).engine.runner
    bf16 = LLM(
        str(tiny_llama_dir), dtype="bfloat16", quantization="int8", kv_cache_memory=1 << 26
    ).engine.runner
    qwen3 = save_tiny_model("qwen3", tmp_path / "qwen3")  # q/k norms stay in torch
    qwen3_runners = [
        LLM(str(qwen3), dtype="float32", quantization=q, kv_cache_memory=1 << 26).engine.runner
        for q in ("int8", None)
    ]
    for runner in (fp8_cache, bf16, *qwen3_runners):
        assert not isinstance(runner.one_token_step, Fp32OneTokenStep)


def test_fp32_one_token_forwards_read_a_row_major_copy_and_give_the_packed_matmuls_result(
    tiny_llama_dir,
):
    """Every fp32 linear keeps a row-major copy for one-token forwards; its result is the
    prepacked oneDNN matmul's (which a two-token forward takes) to fp32 rounding."""
    model = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 26).engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.one_token, Fp32OneTokenWeight) for m in linears)
    assert model.one_token_copy_bytes() == sum(m.weight_bytes for m in linears) - sum(
        0 if m.bias is None else m.bias.numel() * 4 for m in linears
    )
    generator = torch.Generator().manual_seed(0)
    for linear in linears:
        x = torch.randn(2, linear.in_features, generator=generator)
        both = linear(x)  # two tokens: the prepacked weight
        for row in range(2):
            one = linear(x[row : row + 1])
            torch.testing.assert_close(one, both[row : row + 1], atol=1e-5, rtol=1e-5)
