"""Sampling behaviour: seeds, filters, stops, logprobs."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM

from pdserve.engine import SamplingParams

PROMPT = [5, 77, 300, 12, 9, 41, 250, 3, 3, 18]
OTHERS = [[7] * 40, [100, 200, 300], list(range(3, 120))]


def test_same_seed_gives_same_tokens_in_any_batch(clean_tiny_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = clean_tiny_llm.generate([PROMPT], seeded)[0].token_ids
    mixed = clean_tiny_llm.generate(
        OTHERS[:1] + [PROMPT] + OTHERS[1:],
        [SamplingParams(temperature=0.7, max_tokens=30), seeded,
         SamplingParams(temperature=1.2, seed=5, max_tokens=10),
         SamplingParams(temperature=0, max_tokens=20)],
    )[1].token_ids
    assert alone == mixed


def test_different_seeds_give_different_tokens(clean_tiny_llm):
    runs = [
        clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=1.5, seed=s, max_tokens=24))[0]
        for s in (1, 2)
    ]
    assert runs[0].token_ids != runs[1].token_ids


def test_top_k_one_equals_greedy(clean_tiny_llm):
    greedy = clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    top1 = clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=1.3, top_k=1, max_tokens=24))
    assert top1[0].token_ids == greedy.token_ids


def test_tiny_top_p_equals_greedy(clean_tiny_llm):
    greedy = clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    nucleus = clean_tiny_llm.generate([PROMPT], SamplingParams(top_p=1e-6, max_tokens=24))[0]
    assert nucleus.token_ids == greedy.token_ids


def test_top_k_restricts_samples_to_the_k_most_likely(clean_tiny_llm, tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    allowed = set(logits.topk(3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3, seed=s, max_tokens=1) for s in range(40)]
    firsts = {o.token_ids[0] for o in clean_tiny_llm.generate([PROMPT] * 40, params)}
    assert firsts <= allowed
    assert len(firsts) > 1


def test_stop_token_ids_end_the_request_but_not_before_min_tokens(clean_tiny_llm):
    greedy = clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    stop_at = greedy.token_ids[2]
    first = greedy.token_ids.index(stop_at)
    stopped = clean_tiny_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    held = clean_tiny_llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], min_tokens=first + 2),
    )[0]
    assert len(held.token_ids) >= first + 2
    assert stop_at not in held.token_ids[: first + 1]


def test_max_tokens_ends_with_length(clean_tiny_llm):
    out = clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7))[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length"


def test_stop_string_truncates_text_and_finishes_with_stop(clean_tiny_llm):
    full = clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = full.text.index(stop)
    out = clean_tiny_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=32, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert len(out.token_ids) < len(full.token_ids)


def test_logprobs_match_the_reference_distribution(clean_tiny_llm, tiny_llama_dir):
    out = clean_tiny_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=5)
    )[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT + out.token_ids])
        reference = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    assert len(out.logprobs) == 4
    for step, entry in enumerate(out.logprobs):
        row = reference[len(PROMPT) - 1 + step]
        assert entry.token_id == out.token_ids[step]
        assert math.isclose(entry.logprob, float(row[entry.token_id]), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == row.topk(5).indices.tolist()
        assert entry.top[0][0] == entry.token_id
