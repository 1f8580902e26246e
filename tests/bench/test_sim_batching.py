"""The batching simulation drives the real scheduler: continuous batching finishes a workload
in fewer steps than static batching, with fuller slots, and paged KV wastes less than
contiguous reservations."""

from __future__ import annotations

import statistics

from pdserve.bench.sim_batching import make_requests, run_continuous, run_request_level


def test_continuous_batching_beats_static_and_paged_kv_wastes_less():
    requests = make_requests(64, rate=0.5, max_output=256, seed=1)
    static = run_request_level(requests, batch=8, wait_for_full=True)
    dynamic = run_request_level(requests, batch=8, wait_for_full=False)
    continuous, paged, contiguous = run_continuous(requests, 8, 1024, 16, 256)
    assert len(static.latencies) == len(dynamic.latencies) == len(continuous.latencies) == 64
    assert continuous.steps < static.steps
    assert statistics.fmean(continuous.utilisation) > statistics.fmean(static.utilisation)
    assert statistics.fmean(paged) < statistics.fmean(contiguous)
