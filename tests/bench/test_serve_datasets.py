"""The serving benchmark's inputs without a server: dataset lengths and sharing, trace replay,
arrival processes and SLO parsing."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest

from pdserve.bench.serve_arrivals import arrival_times, trace_times
from pdserve.bench.serve_datasets import (
    ChatSpec,
    RandomSpec,
    SharedPrefixSpec,
    TraceSpec,
    chat_lengths,
    chat_requests,
    random_requests,
    shared_prefix_requests,
    trace_block,
    trace_requests,
    warmup_requests,
)
from pdserve.bench.serve_metrics import Slo, parse_slo
from pdserve.bench.serve_vocab import range_vocabulary

VOCAB = list(range(100, 5000))


def test_random_lengths_stay_within_the_range_ratio():
    requests = random_requests(RandomSpec(200, 50, 0.25), 300, VOCAB, seed=1)
    assert len(requests) == 300
    assert all(150 <= len(r.prompt) <= 250 for r in requests)
    assert all(37.5 <= r.max_tokens <= 62.5 for r in requests)
    assert len({len(r.prompt) for r in requests}) > 20  # the range is actually used
    assert all(t in set(VOCAB) for r in requests for t in r.prompt)


def test_random_with_zero_ratio_gives_exact_lengths_and_is_deterministic_per_seed():
    a = random_requests(RandomSpec(64, 8), 5, VOCAB, seed=3)
    assert {len(r.prompt) for r in a} == {64} and {r.max_tokens for r in a} == {8}
    assert [r.prompt for r in a] == [
        r.prompt for r in random_requests(RandomSpec(64, 8), 5, VOCAB, 3)
    ]
    assert [r.prompt for r in a] != [
        r.prompt for r in random_requests(RandomSpec(64, 8), 5, VOCAB, 4)
    ]


def test_range_ratio_outside_zero_to_one_is_rejected():
    with pytest.raises(ValueError, match="range-ratio"):
        RandomSpec(10, 10, 1.0)


def test_shared_prefix_prompts_share_exactly_their_group_prefix():
    spec = SharedPrefixSpec(
        groups=3, prompts_per_group=4, prefix_len=32, suffix_len=8, output_len=5
    )
    requests = shared_prefix_requests(spec, VOCAB, seed=0)
    assert len(requests) == 12
    assert all(len(r.prompt) == 40 and r.max_tokens == 5 for r in requests)
    groups: dict[str, list[list[int]]] = {}
    for r in requests:
        groups.setdefault(r.kind, []).append(r.prompt)
    assert sorted(groups) == ["group-0", "group-1", "group-2"]
    prefixes = set()
    for prompts in groups.values():
        assert len({tuple(p[:32]) for p in prompts}) == 1  # the same prefix ...
        assert len({p[32] for p in prompts}) == len(prompts)  # ... and no token more
        prefixes.add(prompts[0][0])
    assert len(prefixes) == 3  # different groups differ from the first token


def test_chat_lengths_stay_within_their_clips_and_repeat_per_seed():
    spec = ChatSpec(
        input_median=100,
        input_sigma=1.5,
        input_max=400,
        output_median=50,
        output_sigma=1.5,
        output_max=120,
        min_len=8,
    )
    lengths = chat_lengths(spec, 2000, seed=5)
    assert all(8 <= i <= 400 and 8 <= o <= 120 for i, o in lengths)
    assert {8, 400} <= {i for i, _ in lengths} and {8, 120} <= {o for _, o in lengths}
    assert 70 <= statistics.median(i for i, _ in lengths) <= 130
    assert lengths == chat_lengths(spec, 2000, seed=5)
    assert lengths != chat_lengths(spec, 2000, seed=6)
    requests = chat_requests(spec, 10, VOCAB, seed=5)
    assert [(len(r.prompt), r.max_tokens) for r in requests] == lengths[:10]


def _write_trace(path, rows) -> str:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_trace_equal_hash_ids_give_equal_token_blocks(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 40, "output_length": 7, "hash_ids": [11, 12, 13]},
        {"timestamp": 1500, "input_length": 46, "output_length": 3, "hash_ids": [11, 12, 99]},
        {"timestamp": 4000, "input_length": 50, "output_length": 1, "hash_ids": [5]},
    ]
    spec = TraceSpec(_write_trace(tmp_path / "t.jsonl", rows), block_size=16, speedup=2.0)
    a, b, c = trace_requests(spec, VOCAB)
    assert [len(r.prompt) for r in (a, b, c)] == [40, 46, 50]
    assert [r.max_tokens for r in (a, b, c)] == [7, 3, 1]
    assert a.prompt[:32] == b.prompt[:32] == trace_block(11, 16, VOCAB) + trace_block(12, 16, VOCAB)
    assert a.prompt[32:] == trace_block(13, 16, VOCAB)[:8]
    assert b.prompt[32:] == trace_block(99, 16, VOCAB)[:14]
    assert c.prompt[:16] == trace_block(5, 16, VOCAB)  # the rest is request-specific filler
    assert [r.at for r in (a, b, c)] == [0.0, 0.25, 1.5]  # ms from the first, 2x faster
    assert trace_requests(spec, VOCAB, limit=2)[1].prompt == b.prompt


def test_trace_with_a_missing_field_names_the_line(tmp_path):
    path = _write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 3}])
    with pytest.raises(ValueError, match="line 1"):
        trace_requests(TraceSpec(path), VOCAB)


def test_trace_times_are_offsets_from_the_first_timestamp():
    assert trace_times([5000, 5000, 7000], speedup=1.0) == [0.0, 0.0, 2.0]


def test_warmup_prompts_are_short_and_unlike_the_dataset():
    warm = warmup_requests(3, VOCAB, seed=0)
    assert [(len(r.prompt), r.max_tokens) for r in warm] == [(64, 8)] * 3
    measured = random_requests(RandomSpec(64, 8), 3, VOCAB, seed=0)
    assert [r.prompt for r in warm] != [r.prompt for r in measured]


def test_arrivals_repeat_per_seed_and_start_at_zero():
    a = arrival_times(50, 4.0, "gamma", 0.5, seed=1)
    assert a == arrival_times(50, 4.0, "gamma", 0.5, seed=1)
    assert a != arrival_times(50, 4.0, "gamma", 0.5, seed=2)
    assert a[0] == 0.0 and a == sorted(a)


@pytest.mark.parametrize("arrival,burstiness", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0)])
def test_mean_inter_arrival_is_one_over_the_rate(arrival, burstiness):
    times = arrival_times(20001, 5.0, arrival, burstiness, seed=0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert math.isclose(statistics.fmean(gaps), 0.2, rel_tol=0.03)
    # the Gamma shape sets the spread: coefficient of variation 1 / sqrt(shape)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert math.isclose(cv, 1 / math.sqrt(burstiness), rel_tol=0.08)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(7, float("inf")) == [0.0] * 7


def test_bad_arrival_settings_are_rejected():
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, "poisson", 0.5)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0)


def test_slo_parsing_accepts_either_part_in_milliseconds():
    assert parse_slo("ttft:500,tpot:50") == Slo(0.5, 0.05)
    assert parse_slo("tpot:25") == Slo(None, 0.025)
    assert parse_slo(" TTFT : 1500 ") == Slo(1.5, None)
    assert parse_slo(None) == Slo() and parse_slo("") == Slo()


@pytest.mark.parametrize(
    "text,message",
    [
        ("ttft=500", "NAME:MS"),
        ("itl:5", "NAME:MS"),
        ("ttft:fast", "expected milliseconds"),
        ("ttft:-1", "positive"),
        ("ttft:1,ttft:2", "twice"),
    ],
)
def test_slo_parse_errors_say_what_was_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def test_vocab_size_range_keeps_clear_of_both_ends():
    ids = range_vocabulary(49152).ids
    assert ids[0] == 491 and ids[-1] == 49152 - 492
