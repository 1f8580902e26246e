"""CUDA graphs on and off, compiled Triton kernels: the same greedy tokens as transformers in
fp32, and the same tokens as each other in bf16, where a replayed graph must compute exactly
what the eager step computes. Needs a CUDA device and TRITON_INTERPRET=0; skipped otherwise."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM
from pdserve.testing.tiny_models import save_tiny_model
from tests.engine.test_greedy_parity import generate_and_check_clean, make_prompts, reference_greedy
from tests.kernels.kernel_cases import DEVICE

pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda", reason="needs a CUDA device and compiled kernels (TRITON_INTERPRET=0)"
)
OPTIONS = {"device": "cuda", "attention_backend": "triton", "max_num_seqs": 8, "num_kv_blocks": 160}


def run(model_dir, prompts, dtype: str, cuda_graphs: bool) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype=dtype, cuda_graphs=cuda_graphs, **OPTIONS)
    assert (llm.engine.runner.decode_graphs is not None) == cuda_graphs
    return generate_and_check_clean(llm, prompts)


def test_cuda_graphs_on_and_off_give_transformers_greedy_tokens_in_fp32(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path)
    prompts = make_prompts()
    expected = reference_greedy(model_dir, prompts)
    assert run(model_dir, prompts, "float32", cuda_graphs=False) == expected
    assert run(model_dir, prompts, "float32", cuda_graphs=True) == expected


def test_cuda_graph_replay_gives_the_eager_tokens_in_bf16(tmp_path):
    model_dir = save_tiny_model("qwen3", tmp_path)
    prompts = make_prompts(seed=1)
    assert run(model_dir, prompts, "bfloat16", cuda_graphs=True) == run(
        model_dir, prompts, "bfloat16", cuda_graphs=False
    )
