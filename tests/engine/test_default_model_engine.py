"""The engine on the real default model (SmolLM2-135M-Instruct, downloaded once)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def default_llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32")


def test_default_model_answers_the_capital_of_france(default_llm):
    out = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    default_llm.engine.check_integrity()


def test_default_model_greedy_equals_transformers(default_llm, default_model_dir):
    prompts = ["The history of the printing press", "def fibonacci(n):"]
    encoded = [default_llm.tokenizer.encode(p) for p in prompts]
    reference = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    expected = []
    for ids in encoded:
        out = reference.generate(
            torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
        expected.append(out[0, len(ids):].tolist())
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    got = [o.token_ids for o in default_llm.generate(encoded, params)]
    assert got == expected
    manager = default_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
