"""The compiled one-sequence step with int8 weights (engine/runner/int8_one_token_step.py,
kernels/cpu_int8_decode_step.py), on any CPU: from the same cache state it writes the keys and
values and gives the logits of the torch forward over the same int8 weights, to fp32 rounding
(the order of sums), with a sliding window shorter than the context too; the runner takes it
for one sequence decoding one token only, and greedy text equals the torch forward's; it is not
built where a part of it cannot run. tests/kernels/test_instruction_sets.py runs this file
again with numba compiling for AVX2."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.runner.int8_one_token_step import Int8OneTokenStep
from pdserve.testing.tiny_models import save_tiny_model
from tests.engine.test_compiled_decode import BLOCK_TABLE, PROMPT_LEN, torch_forward

pytest.importorskip("numba")


@pytest.fixture(scope="module", params=["llama", "llama3-rope-tied", "mistral", "qwen2"])
def int8_llm(request, tmp_path_factory):
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return LLM(str(folder), dtype="float32", quantization="int8", kv_cache_memory=1 << 26)


def compare_one_step(runner, step: Int8OneTokenStep, token: int) -> None:
    """Prefills a prompt, then decodes `token` both ways from the same cache state."""
    prompt = torch.randint(3, 250, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    torch_forward(runner, prompt.tolist(), 0)
    before = runner.kv_cache.buffer.clone()
    expected = torch_forward(runner, [token], PROMPT_LEN)
    expected_cache = runner.kv_cache.buffer.clone()
    runner.kv_cache.buffer.copy_(before)

    logits = step(torch.tensor([token]), BLOCK_TABLE, PROMPT_LEN + 1)

    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.kv_cache.buffer, expected_cache, atol=1e-5, rtol=1e-5)
    assert (runner.kv_cache.buffer != before).any(), "the step wrote no key or value"


def test_the_compiled_int8_step_gives_the_torch_forwards_logits_and_cache(int8_llm):
    runner = int8_llm.engine.runner
    assert isinstance(runner.one_token_step, Int8OneTokenStep)
    compare_one_step(runner, runner.one_token_step, token=77)


def test_the_compiled_int8_step_reads_only_a_sliding_windows_keys(int8_llm, monkeypatch):
    runner = int8_llm.engine.runner
    window = 12  # of a 41-token context, across three blocks
    monkeypatch.setattr(runner.attention, "sliding_window", window)
    monkeypatch.setattr(runner.attention.cpu_decode, "sliding_window", window)
    step = Int8OneTokenStep(runner.model, runner.kv_cache, runner.attention.scale, window)
    compare_one_step(runner, step, token=120)


def test_the_runner_takes_the_int8_step_for_one_sequence_and_its_text_is_the_torch_forwards(
    int8_llm, monkeypatch
):
    runner = int8_llm.engine.runner
    path = runner.forward_path("one_token_step")
    step, calls = path.step, []
    monkeypatch.setattr(path, "step", lambda *args: calls.append(args) or step(*args))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    alone = int8_llm.generate(prompts[:1], [params])[0].token_ids
    assert len(calls) == 11  # the prompt's step samples the first token; then eleven decodes
    calls.clear()
    together = int8_llm.generate(prompts, [params] * 2)[0].token_ids
    assert len(calls) == 0  # two sequences decoding: the torch forward
    assert list(alone) == list(together)
    int8_llm.engine.check_integrity()


def test_no_compiled_int8_step_where_a_part_cannot_run(tiny_llama_dir, tmp_path):
    exact = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 26).engine.runner
    fp8_cache = LLM(
        str(tiny_llama_dir), dtype="float32", quantization="int8", kv_cache_dtype="fp8",
        kv_cache_memory=1 << 26,
    ).engine.runner
    bf16 = LLM(
        str(tiny_llama_dir), dtype="bfloat16", quantization="int8", kv_cache_memory=1 << 26
    ).engine.runner
    qwen3 = save_tiny_model("qwen3", tmp_path / "qwen3")  # q/k norms stay in torch
    qwen3_runner = LLM(
        str(qwen3), dtype="float32", quantization="int8", kv_cache_memory=1 << 26
    ).engine.runner
    for runner in (exact, fp8_cache, bf16, qwen3_runner):
        assert not isinstance(runner.one_token_step, Int8OneTokenStep)
