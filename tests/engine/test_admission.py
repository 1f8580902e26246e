"""Admission by worst case vs predicted output length: the predictor's quantile, concurrency,
and mispredictions covered by preemption with every block returned."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.kv.admission import AdmissionPolicy, OutputLengthPredictor
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.wire.sampling_params import SamplingParams


def test_the_predictor_reserves_the_quantile_of_observed_fractions_of_max_tokens():
    predictor = OutputLengthPredictor(quantile=0.9, window=100, min_observations=10)
    assert predictor.predict(100, ignore_eos=False) == 100  # nothing observed yet
    for used in range(1, 11):  # fractions 0.1 .. 1.0 of max_tokens 10
        predictor.observe(used, 10)
    assert predictor.predict(100, ignore_eos=False) == 90
    assert predictor.predict(50, ignore_eos=False) == 45
    assert predictor.predict(100, ignore_eos=True) == 100
    for _ in range(100):  # the window forgets the old observations
        predictor.observe(2, 10)
    assert predictor.predict(100, ignore_eos=False) == 20


def test_policies_reserve_prompt_plus_expected_output_in_blocks():
    seq = Sequence("a", [1] * 10, SamplingParams(max_tokens=30), frozenset(), torch.device("cpu"))
    assert AdmissionPolicy("optimistic", 4).expected_blocks(seq) == 0
    assert AdmissionPolicy("worst-case", 4).expected_blocks(seq) == 10
    with pytest.raises(ValueError, match="admission"):
        AdmissionPolicy("hopeful", 4)


def run(policy: str, num_requests: int = 128, long_every: int = 16) -> tuple[float, int]:
    """Requests of 8 prompt tokens with max_tokens 64 that stop after 4 tokens (every
    `long_every`-th runs 40); returns mean running sequences per step and preemptions."""
    manager = BlockManager(40, 4)
    scheduler = Scheduler(
        manager, 4096, max_num_seqs=64, watermark=0, admission=AdmissionPolicy(policy, 4, 0.9)
    )
    for index in range(num_requests):
        scheduler.add(
            Sequence(
                f"r{index}", [1] * 8, SamplingParams(max_tokens=64), frozenset(),
                torch.device("cpu"), arrival_time=float(index),
            )
        )
    concurrency = []
    while scheduler.num_unfinished:
        for scheduled in scheduler.schedule().scheduled:
            seq = scheduled.seq
            samples = scheduled.completes_prompt
            seq.num_computed_tokens += scheduled.num_new_tokens
            if samples:
                seq.append_token(1)
                target = 40 if int(seq.request_id[1:]) % long_every == 0 else 4
                if seq.num_output_tokens >= target:
                    scheduler.finish(seq, "stop")
        concurrency.append(len(scheduler.running))
    manager.check_integrity([])
    assert manager.num_free_blocks == 40
    return sum(concurrency) / len(concurrency), scheduler.num_preemptions


def test_worst_case_admission_never_preempts_but_runs_few_requests_at_once():
    mean_running, preemptions = run("worst-case")
    assert preemptions == 0
    assert mean_running <= 40 // 18 + 0.01  # 8 + 64 tokens need 18 blocks of 4


def test_predicted_admission_runs_more_at_once_and_preemption_covers_the_misses():
    worst_running, _ = run("worst-case")
    predicted_running, preemptions = run("predicted")
    assert predicted_running >= 2 * worst_running
    _, optimistic_preemptions = run("optimistic")
    assert preemptions <= optimistic_preemptions


@pytest.mark.parametrize("admission", ["worst-case", "predicted"])
def test_greedy_tokens_do_not_depend_on_the_admission_policy(tiny_llama_dir, admission):
    prompts = [[(7 * i + j) % 400 + 3 for j in range(20 + i)] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=30)
    reference = LLM(str(tiny_llama_dir), dtype="float32").generate(prompts, params)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=12, admission=admission)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
