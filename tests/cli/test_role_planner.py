"""The run-time planner's policy (commands/role_planner.py) and its settings
(commands/planner_settings.py): pure, driven by hand-made snapshots of the router's signals."""

from __future__ import annotations

import pytest

from pdserve.commands.planner_settings import PlannerSettings
from pdserve.commands.role_planner import (
    ChangeReason,
    ClusterSignals,
    LoadPolicy,
    NodeSignals,
)
from pdserve.wire.roles import Role

SETTINGS = PlannerSettings(
    planner="load", planner_prefill_delay_high_s=2.0, planner_prefill_delay_low_s=0.5,
    planner_kv_usage_high=0.8, planner_kv_usage_low=0.3, planner_decode_waiting_high=4,
    planner_sustain_s=3.0, planner_min_dwell_s=10.0,
)


def node(node_id: str, role: str, *, delay=0.0, used=0, waiting=0, running=0, state="serving",
         live=True) -> NodeSignals:
    return NodeSignals(
        node_id, role, live, state, num_waiting=waiting, num_running=running,
        kv_free_blocks=100 - used, kv_total_blocks=100, queue_delay_s=delay,
    )


def prefill_heavy(now: float, **changes) -> ClusterSignals:
    """1 prefill node with a long queue, 2 decode nodes with their KV mostly free."""
    nodes = {
        "p0": node("p0", "prefill", delay=5.0),
        "d0": node("d0", "decode", used=20, running=4),
        "d1": node("d1", "decode", used=10, running=2),
        **changes,
    }
    return ClusterSignals(now, tuple(nodes.values()))


def decode_heavy(now: float, **changes) -> ClusterSignals:
    """2 prefill nodes idle, 1 decode node with its KV nearly full."""
    nodes = {
        "p0": node("p0", "prefill"),
        "p1": node("p1", "prefill", delay=0.1),
        "d0": node("d0", "decode", used=90, running=30),
        **changes,
    }
    return ClusterSignals(now, tuple(nodes.values()))


def first_decision(policy: LoadPolicy, snapshot, start: float, stop: float, step: float = 0.5):
    now = start
    while now <= stop:
        decision = policy.decide(snapshot(now))
        if decision is not None:
            return now, decision
        now += step
    return None, None


def test_a_long_prefill_queue_with_free_decode_kv_turns_the_least_busy_decode_node():
    policy = LoadPolicy(SETTINGS, started_at=0.0)
    at, change = first_decision(policy, prefill_heavy, 0.0, 60.0)
    assert at == 10.0  # held since 0 (sustain 3 s), but the first dwell runs to 10 s
    assert (change.node_id, change.from_role, change.to_role) == ("d1", Role.DECODE, Role.PREFILL)
    assert change.reason == ChangeReason.PREFILL_QUEUE
    assert "prefill queue delay 5.00 s" in change.describe()


def test_full_decode_kv_or_a_decode_queue_with_prefill_idle_turns_a_prefill_node():
    policy = LoadPolicy(SETTINGS, started_at=-100.0)
    at, change = first_decision(policy, decode_heavy, 0.0, 60.0)
    assert at == 3.0  # the sustain alone
    assert (change.node_id, change.to_role, change.reason) == ("p0", Role.DECODE, "decode_kv")
    queued = lambda now: decode_heavy(now, d0=node("d0", "decode", used=50, waiting=6))
    _, change = first_decision(LoadPolicy(SETTINGS, -100.0), queued, 0.0, 60.0)
    assert change.reason == ChangeReason.DECODE_QUEUE


def test_a_condition_must_hold_at_every_reading_for_the_sustain_time():
    policy = LoadPolicy(SETTINGS, started_at=-100.0)
    assert policy.decide(prefill_heavy(0.0)) is None
    assert policy.decide(prefill_heavy(2.9)) is None
    calm = prefill_heavy(3.0, p0=node("p0", "prefill", delay=1.0))  # inside the band: no wish
    assert policy.decide(calm) is None
    assert policy.decide(prefill_heavy(4.0)) is None  # held again only since 4.0
    assert policy.decide(prefill_heavy(6.9)) is None
    assert policy.decide(prefill_heavy(7.0)) is not None


def test_between_the_thresholds_nothing_changes_either_way():
    policy = LoadPolicy(SETTINGS, started_at=-100.0)
    band = lambda now: ClusterSignals(now, (
        node("p0", "prefill", delay=1.0), node("p1", "prefill"),
        node("d0", "decode", used=50, waiting=3), node("d1", "decode", used=50),
    ))
    assert first_decision(policy, band, 0.0, 120.0) == (None, None)
    # Prefill delay high but decode KV not low enough to give a node up: no change either.
    busy_both = lambda now: prefill_heavy(now, d1=node("d1", "decode", used=50))
    assert first_decision(LoadPolicy(SETTINGS, -100.0), busy_both, 0.0, 120.0) == (None, None)


def test_no_change_within_the_dwell_after_a_change():
    policy = LoadPolicy(SETTINGS, started_at=-100.0)
    at, _ = first_decision(policy, prefill_heavy, 0.0, 60.0)
    policy.changed(at)
    three_decode = lambda now: prefill_heavy(now, d2=node("d2", "decode"))
    again, _ = first_decision(policy, three_decode, at, at + 60.0)
    assert again == at + SETTINGS.planner_min_dwell_s


def test_the_last_node_of_a_role_is_never_taken():
    policy = LoadPolicy(SETTINGS, started_at=-100.0)
    one_decode = lambda now: prefill_heavy(now, d1=node("d1", "decode", live=False))
    # d1 down: nothing changes while the cluster is unsettled, and d0 is the last decode node.
    assert first_decision(policy, one_decode, 0.0, 60.0) == (None, None)
    last_decode = lambda now: ClusterSignals(now, (
        node("p0", "prefill", delay=9.0), node("d0", "decode", used=5),
    ))
    assert first_decision(LoadPolicy(SETTINGS, -100.0), last_decode, 0.0, 60.0) == (None, None)
    last_prefill = lambda now: ClusterSignals(now, (
        node("p0", "prefill"), node("d0", "decode", used=95),
    ))
    assert first_decision(LoadPolicy(SETTINGS, -100.0), last_prefill, 0.0, 60.0) == (None, None)


def test_nothing_changes_while_a_node_drains():
    policy = LoadPolicy(SETTINGS, started_at=-100.0)
    draining = lambda now: prefill_heavy(
        now, d2=node("d2", "decode", state="draining")
    )
    assert first_decision(policy, draining, 0.0, 60.0) == (None, None)


def test_a_malformed_router_entry_is_refused():
    entry = {"node_id": "d0", "role": "decode", "live": True, "state": "serving", "held": 0,
             "num_waiting": 0, "num_running": 0, "kv_free_blocks": 10, "kv_total_blocks": 10,
             "queue_delay_s": 0.0}
    assert NodeSignals.from_json(entry).kv_usage == 0.0
    with pytest.raises(ValueError, match="malformed"):
        NodeSignals.from_json({**entry, "held": "many"})
    with pytest.raises(ValueError, match="malformed"):
        NodeSignals.from_json({k: v for k, v in entry.items() if k != "state"})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"planner": "fancy"}, "planner is 'fancy'"),
        ({"planner_kv_usage_high": 1.5}, "planner_kv_usage_high is 1.5; expected 0 to 1"),
        ({"planner_interval_s": 0.0}, "planner_interval_s is 0.0; expected 0.1 to 60"),
        ({"planner_drain_timeout_s": float("nan")}, "planner_drain_timeout_s is nan"),
        ({"planner_kv_usage_high": 0.3, "planner_kv_usage_low": 0.3}, "must exceed the low"),
        (
            {"planner_prefill_delay_high_s": 0.1, "planner_prefill_delay_low_s": 0.2},
            "must exceed the low",
        ),
    ],
)
def test_planner_settings_out_of_bounds_are_refused_by_name(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PlannerSettings(**{"planner": "load", **values})
