"""Our top-level package names must not confuse transformers' optional-package probes."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib.util, pathlib
import pdserve.kernels, pdserve.router, pdserve.engine
hub_kernels = importlib.util.find_spec("kernels")  # Hugging Face's, when transformers needs it
ours = pathlib.Path(pdserve.kernels.__file__).parent
assert hub_kernels is None or pathlib.Path(hub_kernels.origin).parent != ours, hub_kernels.origin
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
