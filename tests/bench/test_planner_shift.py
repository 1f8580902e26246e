"""The planner-shift benchmark's report (bench/planner_shift_report.py) from a hand-made record:
each change the launcher logged becomes a row with its drain start, and every request counts."""

from __future__ import annotations

from pdserve.bench.planner_shift_report import plot, report, role_changes

SIGNALS = "prefill queue delay 0.40 s, decode KV usage 0.05, decode waiting 3.0/node"


def record() -> dict:
    line = "pdserve: planner: {} node decode-0.8000: decode -> prefill (reason prefill_queue; " \
        f"{SIGNALS}, 1 prefill + 2 decode)"
    changed = line.format("changed") + "; now node prefill-1.8000, serving after 18.5 s " \
        "(drained in 0.6 s)"
    return {
        "command": "python -m pdserve.bench.planner_shift",
        "machine": {"cpu": "test"},
        "model": "tiny",
        "serve_flags": ["--planner-prefill-delay-high", "0.15", "--planner-kv-usage-high", "0.3",
                        "--planner-kv-usage-low", "0.2"],
        "phases_config": {"long prompts": [10, [800, 1000], [4, 4]],
                          "long outputs": [96, [16, 32], [300, 600]]},
        "hold_s": 15.0,
        "phases": [
            {"name": "long prompts", "start": 0.0, "end": 40.0, "changed_at": 29.0},
            {"name": "long outputs", "start": 40.0, "end": 80.0, "changed_at": None},
        ],
        "outcomes": {"long prompts": {"completed": 3}, "long outputs": {"completed": 1,
                                                                        "died after a token": 1}},
        "completed_end_s": [1.0, 2.0, 30.0, 60.0],
        "not_completed": [{"phase": "long outputs", "sent_s": 50.0, "end_s": 55.0,
                           "outcome": "died after a token", "why": "error event"}],
        "samples": [
            {"t": t, "prefill": 1, "decode": 2, "draining": [], "prefill_delay_s": 0.4,
             "decode_kv_usage": 0.05, "decode_waiting": 3.0}
            for t in (0.0, 5.0, 10.0)
        ],
        "events": [{"t": 10.4, "line": line.format("draining")}, {"t": 29.0, "line": changed}],
        "settle": {"clean": True, "waited_s": 2.0, "nodes": {}},
    }


def test_each_logged_change_is_a_row_from_its_drain_to_its_new_node_serving(tmp_path):
    changes = role_changes(record())
    assert [(c["old"], c["new"], c["reason"], c["began_t"], c["done_t"]) for c in changes] == [
        ("decode-0.8000", "prefill-1.8000", "prefill_queue", 10.4, 29.0)
    ]
    text = report(record())
    assert "| 10.4 | 29.0 | decode-0.8000 -> prefill-1.8000 | decode -> prefill |" in text
    assert "| long outputs | 2 | 1 | 1 | died after a token: 1 |" in text
    assert "Not completed in all: **1**" in text
    plot(record(), tmp_path / "shift.png")
    assert (tmp_path / "shift.png").stat().st_size > 10_000
