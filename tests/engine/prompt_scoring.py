"""Scoring prompts through a real engine: the logprob of every prompt token given the ones
before it, for tests that bound how far a dtype or a KV cache format moves them."""

from __future__ import annotations

import torch

from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.wire.sampling_params import SamplingParams

NEW_TOKENS = 32
# alternatives a decode step returns: at a step whose distribution is flat (the default model's
# five likeliest tokens within 0.7 nats) a small change moves the fp32 token down many ranks
TOP = 20
GREEDY_WITH_LOGPROBS = SamplingParams(
    temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=TOP
)


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


def greedy_logprob_differences(
    model_dir: str, prompts, decode: bool = True, **config
) -> dict[str, float]:
    """The largest |logprob difference| of the fp32 engine's greedy tokens under an engine
    with `config` (EngineConfig fields, e.g. an fp8 KV cache or int8 weights): scored as prompts
    (whole, and 32 tokens at a time: "whole", "chunked"), and, unless `decode` is False, at
    decode steps while the other engine's tokens follow the fp32 ones ("decode"; the fp32
    token must stay in the other engine's top TOP). Every block is free after."""
    reference = LLM(model_dir, dtype="float32").generate(prompts, GREEDY_WITH_LOGPROBS)
    sequences = [prompt + output.token_ids for prompt, output in zip(prompts, reference)]
    want = prompt_logprobs(model_dir, sequences)
    worst = {}
    for name, chunking in (("whole", {}), ("chunked", {"max_num_batched_tokens": 32})):
        got = prompt_logprobs(model_dir, sequences, **config, **chunking)
        worst[name] = max(
            float((g[len(p) - 1 :] - w[len(p) - 1 :]).abs().max())
            for p, g, w in zip(prompts, got, want)
        )
    if not decode:
        return worst
    other = LLM(model_dir, **{"dtype": "float32", **config})
    worst["decode"] = 0.0
    for output, expected in zip(other.generate(prompts, GREEDY_WITH_LOGPROBS), reference):
        diverged = next(
            (i for i, (a, b) in enumerate(zip(output.token_ids, expected.token_ids)) if a != b),
            None,
        )
        for i in range(NEW_TOKENS if diverged is None else diverged + 1):
            scored = dict(output.logprobs[i].top)
            assert expected.token_ids[i] in scored, f"the fp32 token left the top {TOP} at step {i}"
            difference = abs(scored[expected.token_ids[i]] - expected.logprobs[i].logprob)
            worst["decode"] = max(worst["decode"], difference)
    other.engine.check_integrity()
    assert other.engine.block_manager.num_free_blocks == other.engine.block_manager.num_blocks
    return worst
