"""`pdserve profile --quick` on the tiny test model: a real measurement, written and read
back, that `pdserve plan --workload` plans with."""

from __future__ import annotations

import json

from pdserve.commands.cli import main
from pdserve.planner.profile_file import load_profile
from pdserve.planner.profile_model import StepCost
from tests.planner.test_plan_command import WORKLOAD


def test_a_quick_profile_measures_prefill_and_decode_and_plans(tiny_llama_dir, tmp_path,
                                                                 capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_llama_dir), "--quick", "--threads", "1",
                 "--out", str(out)]) == 0
    profile = load_profile(out)
    [table] = profile.tables
    assert table.threads == 1 and profile.model == tiny_llama_dir.name
    assert profile.kv_bytes_per_token > 0 and profile.transfer_bytes_per_s > 0
    assert "cores" in profile.machine and profile.seconds > 0
    cost = StepCost.fit(table)
    assert cost.prefill_seconds(64) > 0 and cost.decode_seconds(2, 32) > 0
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(WORKLOAD))
    assert main(["plan", "--workload", str(workload), "--slo", "ttft=2,itl=0.2",
                 "--profile", str(out)]) == 0
    assert "recommended: " in capsys.readouterr().out


def test_a_bad_thread_count_is_refused(capsys):
    assert main(["profile", "--threads", "0", "--quick"]) == 2
    assert "--threads is '0'" in capsys.readouterr().err
