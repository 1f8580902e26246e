"""Greedy tokens from the engine with the triton attention backend equal transformers' greedy
generate, token for token: the check of test_greedy_parity.py (eight prompts of 1 to 300 tokens,
48 new tokens each) with the kernels doing the attention - in Triton's interpreter on the CPU,
or compiled on CUDA when the tests run with TRITON_INTERPRET=0.

Two runs (the interpreter is slow): the suite's tiny Llama as test_greedy_parity.py runs it
(whole prompts up to 300 tokens, then decodes), and a tiny Mistral whose sliding window of 40
tokens is shorter than most sequences, under chunked prefill, so decodes, whole prompts and
extends after a cached prefix all meet the window, in mixed steps. (transformers' tokens differ
from the same weights without the window, so the window is really exercised.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from pdserve.engine import LLM
from pdserve.testing.tiny_models import COMMON, byte_tokenizer, save_tiny_model
from tests.engine.test_greedy_parity import generate_and_check_clean, make_prompts, reference_greedy
from tests.kernels.kernel_cases import DEVICE

ENGINE_OPTIONS = {
    "attention_backend": "triton",
    "device": DEVICE.type,
    "dtype": "float32",
    "num_kv_blocks": 128,
}


def save_windowed_mistral(folder):
    torch.manual_seed(0)
    config = MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=40)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_triton_backend_greedy_equals_transformers(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path)
    prompts = make_prompts()
    llm = LLM(str(model_dir), **ENGINE_OPTIONS)
    assert generate_and_check_clean(llm, prompts) == reference_greedy(model_dir, prompts)


def test_triton_backend_greedy_equals_transformers_with_a_window_and_chunked_prefill(tmp_path):
    model_dir = save_windowed_mistral(tmp_path)
    prompts = make_prompts()
    llm = LLM(str(model_dir), max_num_batched_tokens=64, **ENGINE_OPTIONS)
    assert generate_and_check_clean(llm, prompts) == reference_greedy(model_dir, prompts)


@pytest.mark.skipif(
    DEVICE.type != "cuda", reason="needs a CUDA device and compiled kernels (TRITON_INTERPRET=0)"
)
def test_cuda_graph_decode_steps_keep_greedy_tokens(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path)
    prompts = make_prompts()
    llm = LLM(str(model_dir), cuda_graphs=True, max_num_seqs=8, **ENGINE_OPTIONS)
    assert llm.engine.runner.decode_graphs is not None
    assert generate_and_check_clean(llm, prompts) == reference_greedy(model_dir, prompts)
