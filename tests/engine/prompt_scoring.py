"""Scoring prompts through a real engine: the logprob of every prompt token given the ones
before it, for tests that bound how far a dtype or a KV cache format moves them."""

from __future__ import annotations

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.wire.sampling_params import SamplingParams


def prompt_logprobs(model_dir: str, sequences, **config) -> list[torch.Tensor]:
    """Per sequence, the logprob of each token after the first given the ones before it
    (`config`: EngineConfig fields; fp32 unless it names a dtype). Every block is free after."""
    engine = LLMEngine(EngineConfig(model=model_dir, **{"dtype": "float32", **config}))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for i, sequence in enumerate(sequences):
        engine.add_request(str(i), sequence, params)
    scored: dict[str, torch.Tensor] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.prompt_logprobs is not None:
                scored[output.request_id] = torch.tensor(
                    [e.logprob for e in output.prompt_logprobs]
                )
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [scored[str(i)] for i in range(len(sequences))]
