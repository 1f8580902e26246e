"""Our top-level package names must not confuse transformers' optional-package probes."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import pdserve.kernels, pdserve.router, pdserve.engine
from transformers.utils import is_kernels_available
assert not is_kernels_available(), "transformers mistook pdserve's kernels for its hub package"
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from transformers import LlamaConfig
import torch
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1))
model(torch.tensor([[1, 2, 3]]))
print("ok")
"""


def test_transformers_models_import_and_run_beside_our_packages():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_public_api_is_importable():
    from pdserve.engine import LLM, SamplingParams

    assert callable(LLM) and callable(SamplingParams)
