"""Workload files: what a valid one draws, and every bad field refused by its name."""

from __future__ import annotations

import itertools
import json

import pytest

from pdserve.planner.workload import load_workload, parse_workload

VALID = {
    "requests": 50, "seed": 3,
    "arrival": {"process": "gamma", "rate": 2.0, "burstiness": 0.5},
    "classes": [
        {"name": "chat", "share": 0.75, "prompt_tokens": [16, 64], "output_tokens": [48, 48],
         "shared_prefix": {"tokens": 120, "variants": 4}},
        {"name": "document", "share": 0.25, "prompt_tokens": [1200, 1600],
         "output_tokens": [16, 16]},
    ],
}


def with_change(path: str, value) -> dict:
    data = json.loads(json.dumps(VALID))
    *parents, last = path.split(".")
    target = data
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    target[last] = value
    return data


def test_a_valid_file_draws_its_requests_within_every_bound(tmp_path):
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(VALID))
    requests = load_workload(path).sample()
    assert len(requests) == 50 and requests[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(requests))
    for r in requests:
        if r.kind == "chat":
            assert 136 <= r.prompt_tokens <= 184 and r.output_tokens == 48
            assert r.prefix_tokens == 120 and r.prefix_id.startswith("chat/")
        else:
            assert 1200 <= r.prompt_tokens <= 1600 and r.prefix_id is None
    assert {r.kind for r in requests} == {"chat", "document"}
    assert load_workload(path).sample() == requests  # the same file, the same requests


def test_burst_arrivals_come_size_at_a_time_every_interval():
    data = with_change("arrival", {"process": "burst", "size": 3, "interval_s": 5})
    times = [r.arrival_s for r in parse_workload(data).sample()[:7]]
    assert times == [0, 0, 0, 5, 5, 5, 10]


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("arrival.rate", -1, "arrival.rate"),
        ("arrival.process", "uniform", "arrival.process"),
        ("requests", 10**9, "workload.requests"),
        ("classes.0.prompt_tokens", [64, 16], "classes[0].prompt_tokens"),
        ("classes.0.share", 0.5, "shares sum to 0.75"),
        ("classes.1.colour", "red", "classes[1]: unknown field(s) colour"),
        ("classes.0.shared_prefix", {"tokens": 0}, "classes[0].shared_prefix.tokens"),
        ("arrival.burstiness", True, "arrival.burstiness"),
    ],
)
def test_a_bad_field_is_refused_by_name(path, value, named):
    with pytest.raises(ValueError) as refused:
        parse_workload(with_change(path, value))
    assert named in str(refused.value)


def test_an_unreadable_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        load_workload(path)
