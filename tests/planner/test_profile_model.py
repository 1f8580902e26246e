"""The fitted step cost, and a profile's file round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.planner.profile_file import load_profile, save_profile
from pdserve.planner.profile_model import StepCost
from tests.planner.costs import COST, known_profile


def test_the_fit_recovers_the_coefficients_that_timed_the_steps():
    fitted = StepCost.fit(known_profile().tables[0])
    assert fitted.coefficients == pytest.approx(COST.coefficients, rel=1e-6)
    assert max(fitted.relative_errors(known_profile().tables[0])) < 1e-6


def test_no_coefficient_comes_out_negative():
    table = known_profile().tables[0]
    noisy = [dataclasses.replace(s, seconds=s.seconds * (1.2 if i % 2 else 0.8))
             for i, s in enumerate(table.steps)]
    fitted = StepCost.fit(dataclasses.replace(table, steps=noisy))
    assert all(c >= 0 for c in fitted.coefficients)
    assert fitted.decode_seconds(4, 512) > fitted.decode_seconds(1, 512) > 0


def test_a_profile_survives_its_file(tmp_path):
    profile = known_profile()
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_the_nearest_thread_count_is_used():
    profile = known_profile(threads=(1, 4))
    assert profile.table(3).threads == 4 and profile.table(1).threads == 1
    assert profile.table(None).threads == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [({"version": 99}, "profile version is 99"),
     ({"transfer_bytes_per_s": 0}, "transfer_bytes_per_s"),
     ({"tables": []}, "no step table")],
)
def test_a_bad_profile_is_refused(tmp_path, change, message):
    save_profile(known_profile(), tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    data.update(change)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_profile(tmp_path / "p.json")
