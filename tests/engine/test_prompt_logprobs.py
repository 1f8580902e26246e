"""Prompt logprobs from the engine equal transformers' log-softmax of the prompt's logits,
gathered at each next prompt token (fp32, within 1e-4), under chunked prefill, with a prefix
cache that holds the prompt, and through preemption by recompute; each position is delivered
once, with the first token; requests that do not ask add no rows to the model's output."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sample.prompt_logprobs import PromptLogprobs
from pdserve.wire.sampling_params import SamplingParams

TOLERANCE = 1e-4
NUM_TOP = 5


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row p is the distribution of prompt token p + 1."""
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return log_softmax


def make_engine(tiny_llama_dir, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", **config))


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    """Runs the prompts to the end; each request's StepOutputs, in order."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            outputs[output.request_id].append(output)
    engine.check_integrity()
    return outputs


def check_against_reference(entries, prompt, expected: torch.Tensor) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    targets = torch.tensor(prompt[1:])
    want = expected.gather(1, targets[:, None]).squeeze(1)
    got = torch.tensor([e.logprob for e in entries])
    assert torch.allclose(got, want, atol=TOLERANCE), (got - want).abs().max()
    want_top, want_ids = expected.topk(NUM_TOP, dim=-1)
    for position, entry in enumerate(entries):
        ids, values = zip(*entry.top)
        assert list(ids) == want_ids[position].tolist()
        assert torch.allclose(torch.tensor(values), want_top[position], atol=TOLERANCE)
        row = expected[position]
        assert entry.rank == int((row >= row[prompt[position + 1]]).sum())


def prompt_logprobs_of(outputs: list) -> list:
    """The one StepOutput's prompt logprobs; every other output of the request has none."""
    delivered = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(delivered) == 1
    assert outputs[0].prompt_logprobs is delivered[0] and outputs[0].offset == 0
    return delivered[0]


def test_prompt_logprobs_equal_transformers_under_chunked_prefill(tiny_llama_dir, reference):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=24)
    prompts = {f"p{n}": make_prompt(n, n) for n in (1, 2, 23, 24, 25, 70, 150)}
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=NUM_TOP)
    outputs = run(engine, prompts, params)
    for request_id, prompt in prompts.items():
        entries = prompt_logprobs_of(outputs[request_id])
        assert len(entries) == len(prompt) - 1
        if len(prompt) > 1:
            check_against_reference(entries, prompt, reference(prompt))


def test_a_prompt_in_the_prefix_cache_is_still_scored_at_every_position(
    tiny_llama_dir, reference
):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=64, prefix_cache_min_blocks=1)
    prompt = make_prompt(100, 7)
    plain = SamplingParams(temperature=0, max_tokens=2)
    run(engine, {"warm": prompt}, plain)
    assert run(engine, {"hit": prompt}, plain)["hit"][0].num_cached_tokens == 96
    scored = run(
        engine, {"scored": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5)
    )["scored"]
    assert scored[0].num_cached_tokens == 0  # cached positions have no logits: no hit
    check_against_reference(prompt_logprobs_of(scored), prompt, reference(prompt))


def test_recomputed_requests_deliver_each_position_once_and_unchanged(
    tiny_llama_dir, reference
):
    engine = make_engine(
        tiny_llama_dir,
        num_kv_blocks=24,
        block_size=16,
        max_num_batched_tokens=32,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    prompts = {f"r{i}": make_prompt(60 + 7 * i, 100 + i) for i in range(4)}
    params = SamplingParams(
        temperature=0, max_tokens=60, min_tokens=60, prompt_logprobs=NUM_TOP
    )
    outputs = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions_by_mode["recompute"] > 0
    for request_id, prompt in prompts.items():
        check_against_reference(prompt_logprobs_of(outputs[request_id]), prompt, reference(prompt))


def test_requests_that_do_not_ask_add_no_logits_rows(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=40)
    rows: list[int] = []
    forward = engine.runner.model.forward

    def counting_forward(input_ids, positions, logits_indices, *args):
        rows.append(logits_indices.numel())
        return forward(input_ids, positions, logits_indices, *args)

    monkeypatch.setattr(engine.runner.model, "forward", counting_forward)
    run(engine, {"a": make_prompt(30, 1), "b": make_prompt(50, 2)}, SamplingParams(max_tokens=2))
    assert max(rows) <= 2  # one row per sampled sequence, nothing else
    rows.clear()
    run(engine, {"c": make_prompt(30, 3)}, SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert rows[0] == 30  # 29 scored positions and the sampled one


def test_the_decode_side_of_a_prefilled_request_scores_nothing(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = make_prompt(20, 5)
    blocks = engine.reserve_blocks(len(prompt))
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    engine.add_prefilled_request("d", prompt, params, blocks, first_token_id=9)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step().outputs
    assert len(outputs) == 3 and all(o.prompt_logprobs is None for o in outputs)
    engine.check_integrity()


def test_a_chunk_recomputed_after_scoring_skips_the_scored_positions():
    scores = PromptLogprobs(num_top=2, num_prompt_tokens=10)
    assert scores.positions_to_score(0, 4) == range(4)
    scores.num_scored = 4
    assert scores.positions_to_score(0, 6) == range(4, 6)
    assert scores.positions_to_score(4, 100) == range(4, 9)
    with pytest.raises(RuntimeError, match="no logits"):
        scores.positions_to_score(5, 3)
    scores.num_scored = 9
    assert not scores.positions_to_score(30, 1)  # decoding after the prompt
