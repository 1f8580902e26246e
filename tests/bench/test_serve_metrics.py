"""The serving benchmark's arithmetic on hand-computed cases: percentiles, TPOT, throughput,
goodput and SLO attainment."""

from __future__ import annotations

import math

from pdserve.bench.serve_load import RequestTiming, percentile, summarize


def test_percentile_picks_the_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(list(range(101)), 99) == 99
    assert math.isnan(percentile([], 50))


def test_tpot_excludes_the_first_token():
    timing = RequestTiming("chat", ok=True, ttft=1.0, e2e=3.0, output_tokens=5)
    assert timing.tpot == 0.5
    assert RequestTiming("chat", ok=True, ttft=1.0, e2e=1.0, output_tokens=1).tpot == 0.0


def test_goodput_counts_only_requests_within_both_slos():
    timings = [
        RequestTiming("a", ok=True, ttft=0.5, e2e=2.5, output_tokens=5, itls=[0.5] * 4),
        RequestTiming("b", ok=True, ttft=3.0, e2e=4.0, output_tokens=3, itls=[0.5, 0.5]),
        RequestTiming("c", ok=True, ttft=0.2, e2e=8.2, output_tokens=5, itls=[2.0] * 4),
        RequestTiming("d", ok=False),
    ]
    out = summarize(timings, wall=10.0, slo_ttft=1.0, slo_tpot=1.0)
    assert out["completed"] == 3 and out["requests"] == 4
    assert out["throughput_tok_s"] == (5 + 3 + 5) / 10.0
    assert out["goodput"] == 1 / 10.0  # only "a": "b" misses TTFT, "c" misses TPOT (2.0 s)
    assert out["slo_attainment"] == 1 / 4
    assert out["ttft_p50"] == 0.5 and out["ttft_max"] == 3.0
    assert out["itl_max"] == 2.0 and out["itl_p50"] == 0.5
    assert math.isclose(out["tpot_mean"], (0.5 + 0.5 + 2.0) / 3)
