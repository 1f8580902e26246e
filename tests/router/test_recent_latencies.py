"""The window of recently finished choices the SLO planner reads (router/recent_latencies.py),
filled by the router's metrics as choices finish, and served on GET /admin/nodes."""

from __future__ import annotations

import time

import pytest

from pdserve.router.metrics import RouterMetrics
from pdserve.router.recent_latencies import RecentLatencies
from tests.router.test_node_drain import call, make_app


def test_a_choice_leaves_its_ttft_from_arrival_and_its_tpot():
    recent = RecentLatencies()
    recent.record(arrived_at=10.0, first_token_at=10.5, num_tokens=5, now=12.5)
    recent.record(arrived_at=11.0, first_token_at=11.25, num_tokens=1, now=11.25)
    assert recent.describe(now=13.0) == [
        {"age_s": 0.5, "ttft_s": 0.5, "tpot_s": 0.5},  # 4 gaps in 2 s
        {"age_s": 1.75, "ttft_s": 0.25, "tpot_s": None},  # a single token has no gap
    ]


def test_the_window_forgets_by_age_and_keeps_the_newest_entries_only():
    recent = RecentLatencies(window_s=10.0, max_entries=3)
    for second in range(5):
        recent.record(second, second + 0.1, 2, now=second + 0.2)
    assert [round(e["ttft_s"], 3) for e in recent.describe(now=5.0)] == [0.1] * 3
    assert [e["age_s"] for e in recent.describe(now=5.0)] == pytest.approx([2.8, 1.8, 0.8])
    assert len(recent.describe(now=12.5)) == 2  # the entry of second 2 aged out
    assert recent.describe(now=100.0) == []


def test_metrics_record_only_choices_that_had_a_first_token():
    metrics = RouterMetrics("tiny")
    metrics.choice_finished("stop", 1.0, 1.5, 2.0, 3, now=3.0)
    metrics.choice_finished("abort", 1.0, 1.5, None, 0, now=3.0)
    assert metrics.recent.describe(now=3.0) == [{"age_s": 0.0, "ttft_s": 1.0, "tpot_s": 0.5}]


def test_the_admin_route_lists_the_recent_choices(tokenizer):
    app, token = make_app(tokenizer)
    t = time.monotonic()  # the router's clock
    app.state.router.metrics.choice_finished("stop", t - 0.3, t - 0.2, t - 0.1, 2, now=t)
    answer = call(app, "GET", "/admin/nodes", token=token).json()
    [entry] = answer["recent_choices"]
    assert entry["ttft_s"] == pytest.approx(0.2) and entry["tpot_s"] == pytest.approx(0.1)
