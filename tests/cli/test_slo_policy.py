"""`--planner slo` (commands/slo_policy.py): pure, driven by hand-made snapshots of the router's
nodes and of the choices it finished lately. Sustain, dwell and the floor are the shared
`RolePolicy`'s (tests/cli/test_role_planner.py); here, which change the attainment asks for."""

from __future__ import annotations

import pytest

from pdserve.commands.planner_settings import PlannerSettings
from pdserve.commands.role_planner import ChangeReason, ClusterSignals, RecentChoice
from pdserve.commands.slo_policy import SloPolicy, itl_attainment, ttft_attainment
from pdserve.wire.roles import Role
from tests.cli.test_role_planner import first_decision, node

SETTINGS = PlannerSettings(
    planner="slo", planner_slo="ttft=1,itl=0.1", planner_slo_attainment=0.9,
    planner_slo_slack=0.2, planner_slo_window_s=30.0, planner_slo_min_requests=10,
    planner_sustain_s=2.0, planner_min_dwell_s=10.0,
)
NODES = (
    node("p0", "prefill"), node("p1", "prefill"),
    node("d0", "decode", running=4), node("d1", "decode", running=1),
)


def choices(count: int, ttft: float, tpot: float | None, age: float = 1.0):
    return tuple(RecentChoice(age, ttft, tpot) for _ in range(count))


def snapshot(recent):
    return lambda now: ClusterSignals(now, NODES, recent)


def decide(recent, settings=SETTINGS):
    return first_decision(SloPolicy(settings, started_at=-100.0), snapshot(recent), 0.0, 30.0)


def test_attainment_counts_the_choices_within_each_target():
    recent = choices(3, 0.5, 0.05) + choices(1, 2.0, None)
    assert ttft_attainment(recent, 1.0) == 0.75
    assert itl_attainment(recent, 0.1) == 1.0  # the single-token choice has no TPOT
    assert itl_attainment(recent, 0.01) == 0.0
    assert itl_attainment(choices(2, 0.5, None), 0.1) == ttft_attainment((), 1.0) == 1.0


def test_missed_ttft_with_itl_to_spare_turns_the_least_busy_decode_node():
    recent = choices(8, 3.0, 0.05) + choices(12, 0.5, 0.05)  # TTFT 60 %, ITL all within 0.08
    at, change = decide(recent)
    assert at == 2.0  # the sustain
    assert (change.node_id, change.from_role, change.to_role) == ("d1", Role.DECODE, Role.PREFILL)
    assert change.reason == ChangeReason.TTFT_SLO
    assert "TTFT attainment 0.60 (target 1 s)" in change.describe()


def test_missed_itl_with_ttft_to_spare_turns_a_prefill_node():
    recent = choices(5, 0.2, 0.3) + choices(15, 0.2, 0.05)
    _, change = decide(recent)
    assert (change.from_role, change.to_role, change.reason) == (
        Role.PREFILL, Role.DECODE, ChangeReason.ITL_SLO
    )


@pytest.mark.parametrize(
    "recent",
    [
        choices(20, 0.5, 0.05),  # both met: nothing to do
        choices(20, 3.0, 0.3),  # both missed: turning roles cannot help
        choices(5, 3.0, 0.05) + choices(15, 0.5, 0.09),  # TTFT missed, ITL met without slack
        choices(5, 0.2, 0.3) + choices(15, 0.9, 0.05),  # ITL missed, TTFT met without slack
        choices(9, 3.0, 0.05),  # fewer requests than --planner-slo-min-requests
        choices(20, 3.0, 0.05, age=31.0),  # all older than the window
    ],
    ids=["both-met", "both-missed", "itl-no-slack", "ttft-no-slack", "too-few", "too-old"],
)
def test_no_change_without_a_clear_side_to_take_a_node_from(recent):
    assert decide(recent) == (None, None)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"planner": "slo"}, "--planner slo needs its targets"),
        ({"planner": "slo", "planner_slo": "ttft=1"}, "--planner-slo lacks itl"),
        ({"planner": "slo", "planner_slo": "ttft=1,itl=-2"}, "--planner-slo itl is -2"),
        ({"planner": "load", "planner_slo": "ttft=1,itl=1"}, "not of --planner load"),
        ({"planner": "slo", "planner_slo": "ttft=1,itl=1", "planner_slo_attainment": 0.0},
         "planner_slo_attainment is 0.0"),
        ({"planner": "slo", "planner_slo": "ttft=1,itl=1", "planner_slo_window_s": 500.0},
         "planner_slo_window_s is 500.0; expected 1 to 120"),
    ],
)
def test_slo_settings_out_of_bounds_are_refused_by_name(values, message):
    with pytest.raises(ValueError, match=message):
        PlannerSettings(**values)
