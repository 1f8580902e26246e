"""Penalties, logit biases and min-p: each against a reference implementation on random logits,
batched with rows that don't use it (left as they were), then end to end on the tiny model."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from pdserve.engine import SamplingParams
from pdserve.engine.sample.logits_processors import apply_logit_bias, apply_penalties
from pdserve.engine.sample.sampler import Sampler, sampling_probs
from pdserve.engine.sequence import Sequence

VOCAB = 512
CPU = torch.device("cpu")
PROMPT = [5, 77, 300, 12, 9, 41, 250, 3, 3, 18]


def make_seq(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams(**params), frozenset(), CPU)
    seq.token_ids.extend(output)
    return seq


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * 4


def random_ids(length: int, seed: int, high: int = 40) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (length,), generator=generator).tolist()


def add_presence_and_frequency(row: torch.Tensor, output: list[int], presence, frequency):
    expected = row.clone()
    for token_id, count in Counter(output).items():
        expected[token_id] -= presence + frequency * count
    return expected


def test_repetition_penalty_matches_transformers_on_prompt_and_output_tokens():
    seqs = [
        make_seq(random_ids(30, 1), random_ids(12, 2), repetition_penalty=1.3),
        make_seq(random_ids(30, 3), random_ids(12, 4)),
        make_seq(random_ids(5, 5), [], repetition_penalty=0.6),
        make_seq(random_ids(30, 6, high=VOCAB), random_ids(40, 7), repetition_penalty=2.0),
        make_seq(random_ids(8, 8), random_ids(3, 9), temperature=0),
    ]
    logits = random_logits(len(seqs))
    processed = logits.clone()
    apply_penalties(processed, seqs)
    for row, seq in enumerate(seqs):
        if seq.params.repetition_penalty == 1.0:
            assert torch.equal(processed[row], logits[row])
            continue
        reference = RepetitionPenaltyLogitsProcessor(seq.params.repetition_penalty)(
            torch.tensor([seq.token_ids]), logits[row : row + 1].clone()
        )[0]
        torch.testing.assert_close(processed[row], reference, rtol=0, atol=0)


def test_presence_and_frequency_penalties_match_a_per_row_reference():
    cases = [
        {"presence_penalty": 0.5, "frequency_penalty": 0.0},
        {},
        {"presence_penalty": 0.0, "frequency_penalty": 2.0},
        {"presence_penalty": -2.0, "frequency_penalty": -0.7},
        {"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 1.0},
        {"logprobs": 2},
    ]
    seqs = [
        make_seq(random_ids(20, 10 + i), random_ids(25, 20 + i), **params)
        for i, params in enumerate(cases)
    ]
    logits = random_logits(len(seqs), seed=1)
    processed = logits.clone()
    apply_penalties(processed, seqs)
    for row, seq in enumerate(seqs):
        expected = add_presence_and_frequency(
            logits[row], seq.output_token_ids,
            seq.params.presence_penalty, seq.params.frequency_penalty,
        )
        if not seq.params.penalized:
            assert torch.equal(processed[row], logits[row])
        torch.testing.assert_close(processed[row], expected)


def test_prompt_tokens_count_for_repetition_but_not_for_presence_or_frequency():
    prompt, output = [7, 7, 8], [9, 9, 9]
    both = make_seq(prompt, output, repetition_penalty=1.5, presence_penalty=1.0,
                    frequency_penalty=0.25)
    logits = torch.full((1, VOCAB), 3.0)
    logits[0, 8] = -3.0
    apply_penalties(logits, [both])
    assert logits[0, 7].item() == 2.0  # prompt only: 3 / 1.5
    assert logits[0, 8].item() == -4.5  # prompt only: -3 * 1.5
    assert logits[0, 9].item() == 2.0 - 1.0 - 0.75  # repetition first, then the others
    assert logits[0, 10].item() == 3.0


def test_logit_bias_matches_a_per_row_reference_and_skips_ids_outside_the_vocabulary():
    seqs = [
        make_seq([1], [], logit_bias={"17": 100, "3": -100, "500": 0.5}),
        make_seq([1], []),
        make_seq([1], [4], temperature=0, logit_bias={17: -3.25, 9: 7}),
        make_seq([1], [], logit_bias={VOCAB: 5.0, 2**31 - 1: 1.0, 0: 1.0}),
    ]
    logits = random_logits(len(seqs), seed=2)
    processed = logits.clone()
    apply_logit_bias(processed, seqs)
    for row, seq in enumerate(seqs):
        expected = logits[row].clone()
        for token_id, bias in seq.params.logit_bias.items():
            if token_id < VOCAB:
                expected[token_id] += bias
        assert torch.equal(processed[row], expected)


def test_min_p_matches_transformers_min_p_warper_after_temperature():
    cases = [
        {"min_p": 0.05, "temperature": 1.0},
        {"temperature": 0.8},
        {"min_p": 0.3, "temperature": 2.5},
        {"min_p": 1.0, "temperature": 0.5},
        {"min_p": 0.5, "temperature": 1.0, "seed": 3},
    ]
    seqs = [make_seq([1], [], **params) for params in cases]
    logits = random_logits(len(seqs), seed=3)
    probs = sampling_probs(logits.clone(), seqs)
    for row, seq in enumerate(seqs):
        scaled = logits[row : row + 1] / seq.params.temperature
        if seq.params.min_p:
            scaled = MinPLogitsWarper(seq.params.min_p)(None, scaled)
        torch.testing.assert_close(probs[row], scaled.softmax(dim=-1)[0])
    assert (probs[3] > 0).sum() == 1


def test_greedy_row_with_a_strong_logit_bias_picks_the_biased_token():
    seqs = [
        make_seq([1, 2], [], temperature=0, logit_bias={"17": 100}),
        make_seq([1, 2], [], temperature=0),
        make_seq([1, 2], [], temperature=1.0, seed=4, logit_bias={"33": 100}),
    ]
    logits = random_logits(len(seqs), seed=4)
    tokens = [r.token_id for r in Sampler(0, CPU)(logits.clone(), seqs)]
    assert tokens == [17, int(logits[1].argmax()), 33]


def test_penalties_move_the_greedy_argmax_off_a_repeated_token():
    logits = random_logits(1, seed=5)
    top = int(logits[0].argmax())
    plain = make_seq([1], [top, top], temperature=0)
    penalized = make_seq([1], [top, top], temperature=0, frequency_penalty=2.0)
    sampler = Sampler(0, CPU)
    assert sampler(logits.clone(), [plain])[0].token_id == top
    margin = float(logits[0, top] - logits[0].topk(2).values[1])
    assert margin < 8.0  # two repeats at frequency 2 take 8 off the top logit
    assert sampler(logits.clone(), [penalized])[0].token_id != top


def test_reported_logprobs_are_the_raw_model_distribution():
    seqs = [
        make_seq(PROMPT, [3, 3], temperature=0, logprobs=3, logit_bias={"42": 100},
                 repetition_penalty=1.8, presence_penalty=1.0),
        make_seq(PROMPT, [], temperature=1.0, min_p=0.2, seed=1, logprobs=0),
    ]
    logits = random_logits(len(seqs), seed=6)
    raw = torch.log_softmax(logits, dim=-1)
    results = Sampler(0, CPU)(logits.clone(), seqs)
    assert results[0].token_id == 42
    for row, result in enumerate(results):
        assert math.isclose(result.logprobs.logprob, float(raw[row, result.token_id]))
    assert [t for t, _ in results[0].logprobs.top] == raw[0].topk(3).indices.tolist()


def test_a_batch_without_penalties_never_builds_token_histories(monkeypatch):
    def fail(self):
        raise AssertionError("token history built for a batch without penalties")

    monkeypatch.setattr(Sequence, "token_id_array", fail)
    seqs = [make_seq(PROMPT, [4, 5], temperature=0), make_seq(PROMPT, [], seed=2, min_p=0.1)]
    logits = random_logits(2, seed=7)
    processed = logits.clone()
    apply_penalties(processed, seqs)
    apply_logit_bias(processed, seqs)
    assert torch.equal(processed, logits)
    Sampler(0, CPU)(logits, seqs)


def test_token_id_array_follows_every_kind_of_append():
    seq = make_seq(PROMPT, [], repetition_penalty=1.2)
    assert seq.token_id_array().tolist() == PROMPT
    for token_id in range(40):
        if token_id % 3:
            seq.append_token(token_id)
        else:
            seq.token_ids.append(token_id)  # warm-up and the first token of a prefilled request
        if token_id % 7 == 0:
            assert seq.token_id_array().tolist() == seq.token_ids
    assert seq.token_id_array().tolist() == seq.token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be between -2 and 2, got 2.5"),
        ({"presence_penalty": -2.01}, r"presence_penalty must be between -2 and 2, got -2.01"),
        ({"presence_penalty": math.nan}, r"presence_penalty must be a finite number"),
        ({"presence_penalty": "1"}, r"presence_penalty must be a number, got str"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be between -2 and 2, got -3"),
        ({"frequency_penalty": math.inf}, r"frequency_penalty must be a finite number, got inf"),
        ({"frequency_penalty": True}, r"frequency_penalty must be a number, got bool"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0, 2\], got 0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty must be in \(0, 2\], got -1"),
        ({"repetition_penalty": 2.5}, r"repetition_penalty must be in \(0, 2\], got 2.5"),
        ({"repetition_penalty": None}, r"repetition_penalty must be a number, got NoneType"),
        ({"min_p": -0.1}, r"min_p must be between 0 and 1, got -0.1"),
        ({"min_p": 1.5}, r"min_p must be between 0 and 1, got 1.5"),
        ({"logit_bias": {"5": 101}}, r"logit_bias\[5\] must be between -100 and 100, got 101"),
        ({"logit_bias": {5: -100.5}}, r"logit_bias\[5\] must be between -100 and 100"),
        ({"logit_bias": {5: "x"}}, r"logit_bias\[5\] must be a number, got str"),
        ({"logit_bias": {"-1": 1}}, r"logit_bias keys must be token ids .* got '-1'"),
        ({"logit_bias": {"a1": 1}}, r"logit_bias keys must be token ids .* got 'a1'"),
        ({"logit_bias": {-1: 1}}, r"a logit_bias token id must be between 0 and 2,147,483,647"),
        ({"logit_bias": {2**31: 1}}, r"a logit_bias token id must be between 0 and 2,147,483,647"),
        ({"logit_bias": {1.5: 1}}, r"a logit_bias token id must be an integer, got float"),
        ({"logit_bias": {"5": 1, 5: 2}}, r"logit_bias names token id 5 twice"),
        ({"logit_bias": [[5, 1]]}, r"logit_bias must be a map of token ids to biases, got list"),
        ({"logit_bias": {str(i): 0 for i in range(1025)}},
         r"logit_bias must have at most 1024 entries, got 1,025"),
    ],
)
def test_out_of_range_penalties_and_biases_are_value_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted_and_logit_bias_keys_become_ints():
    params = SamplingParams(
        presence_penalty=-2, frequency_penalty=2, repetition_penalty=2, min_p=1,
        logit_bias={"7": 100, 8: -100, "0009": 0.5},
    )
    assert params.logit_bias == {7: 100.0, 8: -100.0, 9: 0.5}
    assert params.penalized
    assert SamplingParams(repetition_penalty=1e-9, min_p=0).repetition_penalty == 1e-9
    defaults = SamplingParams()
    assert defaults.logit_bias == {}
    assert not defaults.penalized


# End to end, on the tiny model (every test leaves every block free: clean_tiny_llm).


def num_repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


def test_logit_bias_outside_the_vocabulary_is_rejected_at_admission(clean_tiny_llm):
    with pytest.raises(ValueError, match=r"logit_bias token id 512 is outside the vocabulary"):
        clean_tiny_llm.generate([PROMPT], SamplingParams(logit_bias={"512": 1}))


def test_frequency_penalty_reduces_repeats(clean_tiny_llm):
    outputs = clean_tiny_llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, frequency_penalty=f)
         for f in (0.0, 2.0)],
    )
    plain, penalized = (o.token_ids for o in outputs)
    assert num_repeats(penalized) < num_repeats(plain)


def test_repetition_penalty_changes_greedy_output(clean_tiny_llm):
    outputs = clean_tiny_llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=r)
         for r in (1.0, 2.0)],
    )
    assert outputs[0].token_ids != outputs[1].token_ids


def test_greedy_logit_bias_forces_the_token_end_to_end(clean_tiny_llm):
    out = clean_tiny_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, logit_bias={"300": 100})
    )[0]
    assert out.token_ids == [300] * 6


def test_min_p_one_equals_greedy(clean_tiny_llm):
    greedy = clean_tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    min_p = clean_tiny_llm.generate(
        [PROMPT], SamplingParams(temperature=1.5, min_p=1.0, seed=9, max_tokens=24)
    )[0]
    assert min_p.token_ids == greedy.token_ids


def test_penalized_rows_give_the_same_tokens_in_any_batch(clean_tiny_llm):
    seeded = SamplingParams(
        temperature=1.0, seed=77, max_tokens=24, presence_penalty=0.5, frequency_penalty=0.5,
        repetition_penalty=1.3, min_p=0.02, logit_bias={"40": 2.0},
    )
    greedy = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5)
    alone = [clean_tiny_llm.generate([PROMPT], p)[0].token_ids for p in (seeded, greedy)]
    mixed = clean_tiny_llm.generate(
        [[7] * 40, PROMPT, list(range(3, 120)), PROMPT],
        [SamplingParams(temperature=0.7, max_tokens=30), seeded,
         SamplingParams(temperature=0, max_tokens=20, logit_bias={"9": 5}), greedy],
    )
    assert [mixed[1].token_ids, mixed[3].token_ids] == alone
