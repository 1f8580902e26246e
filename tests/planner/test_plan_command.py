"""`pdserve plan --workload`: the ranking, the printed recommendation, refused options; the
capacity plan without --workload is unchanged."""

from __future__ import annotations

import json

import pytest

from pdserve.commands.cli import main
from pdserve.planner.profile_file import save_profile
from pdserve.planner.search import candidates, search
from pdserve.planner.slo import parse_plan_slo
from pdserve.planner.workload import parse_workload
from tests.planner.costs import known_profile

WORKLOAD = {
    "requests": 40, "seed": 1, "arrival": {"process": "poisson", "rate": 1.0},
    "classes": [
        {"name": "chat", "share": 0.8, "prompt_tokens": [16, 64], "output_tokens": [16, 32],
         "shared_prefix": {"tokens": 120, "variants": 2}},
        {"name": "document", "share": 0.2, "prompt_tokens": [800, 1200],
         "output_tokens": [8, 8]},
    ],
}


@pytest.fixture
def files(tmp_path):
    workload, profile = tmp_path / "workload.json", tmp_path / "profile.json"
    workload.write_text(json.dumps(WORKLOAD))
    save_profile(known_profile(), profile)
    return workload, profile


def test_every_layout_of_the_devices_is_a_candidate():
    names = {c.layout.name for c in candidates(3)}
    assert names == {"3x colocated", "1P2D", "2P1D"}
    with pytest.raises(ValueError, match="--devices is 0"):
        candidates(0)


def test_the_ranking_is_by_goodput_per_device():
    ranked = search(parse_workload(WORKLOAD).sample(), known_profile(),
                    parse_plan_slo("ttft=2,itl=0.2"), devices=2)
    per_device = [r.goodput_per_device for r in ranked]
    assert per_device == sorted(per_device, reverse=True) and per_device[0] > 0
    assert len(ranked) == len(candidates(2))


def test_plan_prints_a_recommendation(files, capsys):
    workload, profile = files
    assert main(["plan", "--workload", str(workload), "--slo", "ttft=2,itl=0.2",
                 "--profile", str(profile), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "goodput/dev" in out and "1P1D" in out and "colocated" in out
    assert "recommended: " in out and "--max-num-batched-tokens" in out


def test_plan_json_names_the_recommended_layout(files, capsys):
    workload, profile = files
    main(["plan", "--workload", str(workload), "--slo", "ttft=2,itl=0.2", "--profile",
          str(profile), "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"]["goodput_per_device"] == max(
        e["goodput_per_device"] for e in plan["best_per_layout"]
    )


@pytest.mark.parametrize(
    ("slo", "named"),
    [("ttft=2,tpot=0.2", "'tpot=0.2'"), ("ttft=2", "lacks itl"), ("ttft=-1,itl=0.2", "ttft"),
     ("ttft=2,itl=abc", "itl is 'abc'")],
)
def test_a_bad_slo_is_refused_naming_the_field(files, capsys, slo, named):
    workload, profile = files
    assert main(["plan", "--workload", str(workload), "--slo", slo, "--profile",
                 str(profile)]) == 2
    assert named in capsys.readouterr().err


def test_a_missing_profile_says_how_to_measure_one(files, tmp_path, capsys):
    workload, _ = files
    assert main(["plan", "--workload", str(workload), "--slo", "ttft=2,itl=0.2", "--profile",
                 str(tmp_path / "none.json")]) == 2
    assert "pdserve profile" in capsys.readouterr().err


def test_the_capacity_plan_still_needs_only_a_model(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--seq-lens", "8192"]) == 0
    assert "KV per token" in capsys.readouterr().out
