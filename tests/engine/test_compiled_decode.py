"""The compiled decode paths on the CPU: the one-sequence step in bf16
(engine/runner/one_token_step.py, kernels/cpu_decode_step.py) and the batch step's compiled ops
between the linears, in bf16 and fp32 (engine/runner/decode_batch_step.py,
kernels/cpu_decode_glue.py). From the same cache state each writes the same keys and values and
gives the logits of the torch forward (bf16: on the tiny families bit for bit on the benchmark
CPU, asserted within a bf16 bound; fp32: within 1e-4, the norm's and the attention's sums in
another order), with a sliding window shorter than the context too; the runner takes each only
for the steps it serves; and neither is built where a part of it cannot run."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.batch import build_flat_batch
from pdserve.engine.runner.decode_batch_step import DecodeBatchStep
from pdserve.engine.runner.one_token_step import OneTokenStep
from pdserve.kernels.cpu_gemv import cpu_gemv_available
from pdserve.testing.tiny_models import save_tiny_model

needs_avx512_bf16 = pytest.mark.skipif(
    not cpu_gemv_available(), reason="the one-token kernels need a CPU with AVX512-BF16"
)
CPU = torch.device("cpu")
PROMPT_LEN = 40
BLOCK_TABLE = [5, 9, 2, 7]  # shuffled blocks of a fresh cache


FAMILIES = ["llama", "llama3-rope-tied", "mistral", "qwen2"]


@pytest.fixture(scope="module", params=FAMILIES)
def bf16_llm(request, tmp_path_factory):
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return LLM(str(folder), dtype="bfloat16", kv_cache_memory=1 << 26)


@pytest.fixture(
    scope="module",
    params=[(family, dtype) for dtype in ("bfloat16", "float32") for family in FAMILIES],
    ids=lambda param: "-".join(param),
)
def batch_llm(request, tmp_path_factory):
    """An engine the batch step runs for: bf16 or fp32 (fp32 on any CPU numba compiles for)."""
    family, dtype = request.param
    folder = save_tiny_model(family, tmp_path_factory.mktemp(family))
    return LLM(str(folder), dtype=dtype, kv_cache_memory=1 << 26)


def close_bounds(dtype: torch.dtype) -> tuple[dict, dict]:
    """assert_close's bounds on (logits, cache) between a compiled path and the torch forward:
    in bf16 rounding may differ in rare elements (the norm's sum order), and a bf16 logit of
    magnitude 4-8 has an ulp of 1/32; in fp32 only the order of some sums differs."""
    if dtype == torch.bfloat16:
        return {"atol": 0.25, "rtol": 0}, {"atol": 0.1, "rtol": 1 / 64}
    return {"atol": 1e-4, "rtol": 1e-4}, {"atol": 1e-5, "rtol": 1e-5}


def torch_forward(runner, tokens: list[int], context_len: int, table=BLOCK_TABLE) -> torch.Tensor:
    batch = build_flat_batch(
        [tokens], [context_len], [table], [True], runner.config.block_size, CPU
    )
    metadata = runner.attention.prepare(batch)
    return runner.model(
        batch.input_ids, batch.positions, batch.logits_indices, runner.attention, metadata
    )


def compare_one_step(runner, step: OneTokenStep, token: int) -> None:
    """Prefills a prompt, then decodes `token` both ways from the same cache state."""
    prompt = torch.randint(3, 250, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    torch_forward(runner, prompt.tolist(), 0)
    before = runner.kv_cache.buffer.clone()
    expected = torch_forward(runner, [token], PROMPT_LEN).float()
    expected_cache = runner.kv_cache.buffer.clone()
    runner.kv_cache.buffer.copy_(before)

    logits = step(torch.tensor([token]), BLOCK_TABLE, PROMPT_LEN + 1).float()

    assert logits.shape == expected.shape
    # Rounding may differ in rare elements (the norm's sum order); a bf16 logit of magnitude
    # 4-8 has an ulp of 1/32.
    torch.testing.assert_close(logits, expected, atol=0.25, rtol=0)
    torch.testing.assert_close(
        runner.kv_cache.buffer.float(), expected_cache.float(), atol=0.1, rtol=1 / 64
    )
    written = runner.kv_cache.buffer != before
    assert written.any(), "the step wrote no key or value"


@needs_avx512_bf16
def test_the_compiled_step_gives_the_torch_forwards_logits_and_cache(bf16_llm):
    runner = bf16_llm.engine.runner
    assert runner.one_token_step is not None
    compare_one_step(runner, runner.one_token_step, token=77)


@needs_avx512_bf16
def test_the_compiled_step_reads_only_a_sliding_windows_keys(bf16_llm, monkeypatch):
    runner = bf16_llm.engine.runner
    window = 12  # of a 41-token context, across three blocks
    monkeypatch.setattr(runner.attention, "sliding_window", window)
    monkeypatch.setattr(runner.attention.cpu_decode, "sliding_window", window)
    step = OneTokenStep(runner.model, runner.kv_cache, runner.attention.scale, window)
    compare_one_step(runner, step, token=120)


@needs_avx512_bf16
def test_the_runner_takes_the_step_for_one_sequence_decoding_one_token_only(
    bf16_llm, monkeypatch
):
    runner = bf16_llm.engine.runner
    path = runner.forward_path("one_token_step")
    step, calls = path.step, []
    monkeypatch.setattr(path, "step", lambda *args: calls.append(args) or step(*args))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    alone = bf16_llm.generate(prompts[:1], [params])[0].token_ids
    assert len(calls) == 5  # the prompt's step samples the first token; then five decodes
    calls.clear()
    together = bf16_llm.generate(prompts, [params] * 2)[0].token_ids
    assert len(calls) == 0  # two sequences decoding: the torch forward
    assert list(alone) == list(together)
    bf16_llm.engine.check_integrity()


# Three sequences of 40, 17 and 3 tokens on shuffled blocks of a fresh cache.
BATCH_TABLES = [[5, 9, 2, 7], [11, 4], [13]]
BATCH_LENS = [40, 17, 3]


def compare_batch_step(runner, step: DecodeBatchStep, tokens: list[int]) -> None:
    """Prefills three prompts, then decodes one token each both ways from the same state."""
    generator = torch.Generator().manual_seed(1)
    for table, length in zip(BATCH_TABLES, BATCH_LENS):
        prompt = torch.randint(3, 250, (length,), generator=generator).tolist()
        torch_forward(runner, prompt, 0, table)
    before = runner.kv_cache.buffer.clone()
    batch = build_flat_batch(
        [[t] for t in tokens], BATCH_LENS, BATCH_TABLES, [True] * 3, runner.config.block_size,
        CPU,
    )
    metadata = runner.attention.prepare(batch)
    expected = runner.model(
        batch.input_ids, batch.positions, batch.logits_indices, runner.attention, metadata
    ).float()
    expected_cache = runner.kv_cache.buffer.clone()
    runner.kv_cache.buffer.copy_(before)

    logits = step(
        batch.input_ids, batch.positions, BATCH_TABLES, [n + 1 for n in BATCH_LENS]
    ).float()

    logits_bounds, cache_bounds = close_bounds(runner.kv_cache.buffer.dtype)
    assert logits.shape == expected.shape == (3, expected.shape[1])
    torch.testing.assert_close(logits, expected, **logits_bounds)
    torch.testing.assert_close(
        runner.kv_cache.buffer.float(), expected_cache.float(), **cache_bounds
    )
    assert (runner.kv_cache.buffer != before).any(), "the step wrote no key or value"


def test_the_batch_step_gives_the_torch_forwards_logits_and_cache(batch_llm):
    runner = batch_llm.engine.runner
    assert runner.decode_batch_step is not None
    compare_batch_step(runner, runner.decode_batch_step, [77, 120, 31])


def test_the_batch_step_reads_only_a_sliding_windows_keys(batch_llm, monkeypatch):
    runner = batch_llm.engine.runner
    window = 12
    monkeypatch.setattr(runner.attention, "sliding_window", window)
    if runner.attention.cpu_decode is not None:
        monkeypatch.setattr(runner.attention.cpu_decode, "sliding_window", window)
    step = DecodeBatchStep(runner.model, runner.kv_cache, runner.attention.scale, window)
    compare_batch_step(runner, step, [8, 9, 10])


def test_the_runner_takes_the_batch_step_for_decode_only_steps(batch_llm, monkeypatch):
    runner = batch_llm.engine.runner
    path = runner.forward_path("decode_batch_step")
    step, calls = path.step, []
    monkeypatch.setattr(path, "step", lambda *args: calls.append(len(args[0])) or step(*args))
    monkeypatch.setattr(
        runner, "forward_paths", [p for p in runner.forward_paths if p.name != "one_token_step"]
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    batch_llm.generate([[5, 6, 7, 8], [9, 10, 11]], [params] * 2)

    assert calls == [2, 2, 2]  # the prefill samples the first tokens; three decode steps
    batch_llm.engine.check_integrity()


def test_no_compiled_step_where_a_part_cannot_run(tiny_llama_dir, tmp_path):
    fp32 = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=1 << 26).engine.runner
    fp8_cache = LLM(
        str(tiny_llama_dir), dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_memory=1 << 26
    ).engine.runner
    qwen3 = save_tiny_model("qwen3", tmp_path / "qwen3")  # q/k norms stay in torch
    qwen3_runner = LLM(str(qwen3), dtype="bfloat16", kv_cache_memory=1 << 26).engine.runner
    for runner in (fp32, fp8_cache, qwen3_runner):
        assert not isinstance(runner.one_token_step, OneTokenStep)
    for runner in (fp8_cache, qwen3_runner):
        assert runner.decode_batch_step is None
    assert fp32.one_token_step is not None  # fp32's own (tests/engine/test_fp32_decode_step.py)
    assert fp32.decode_batch_step is not None
