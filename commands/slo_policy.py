"""`--planner slo`: turn nodes between prefill and decode by how many recent requests met their
latency targets, as the SLO-driven planners of disaggregated servers do (time to first token is
the prefill side's target, the inter-token latency the decode side's).

The sustain, dwell and floor rules and the choice of node are every policy's
(`RolePolicy`, commands/role_planner.py); this policy only says which change it wishes for a
snapshot. Over the choices the router finished within `--planner-slo-window`
(router/recent_latencies.py), with `--planner-slo ttft=T,itl=I`, attainment `A` and slack `S`:

  TTFT attainment  the fraction whose time to first token was at most T
  ITL attainment   the fraction, of those with more than one token, whose mean inter-token
                   latency (TPOT) was at most I (1 when none has a second token)

  TTFT attainment < A, and ITL attainment at the tightened target I * (1 - S) >= A
      -> a decode node becomes a prefill node                               reason ttft_slo
  ITL attainment < A, and TTFT attainment at the tightened target T * (1 - S) >= A
      -> a prefill node becomes a decode node                               reason itl_slo

Hysteresis: a role gives up a node only while it meets its own target with the slack to spare,
so the change does not at once make that role miss and ask for the node back. Both targets
missed, or fewer than `--planner-slo-min-requests` choices in the window: no change (turning
roles cannot help; more devices would).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.commands.role_planner import (
    ChangeReason,
    ClusterSignals,
    RecentChoice,
    RolePolicy,
    Wish,
)
from pdserve.wire.roles import Role


def ttft_attainment(choices: Sequence[RecentChoice], target_s: float) -> float:
    return sum(c.ttft_s <= target_s for c in choices) / len(choices) if choices else 1.0


def itl_attainment(choices: Sequence[RecentChoice], target_s: float) -> float:
    timed = [c.tpot_s for c in choices if c.tpot_s is not None]
    return sum(t <= target_s for t in timed) / len(timed) if timed else 1.0


class SloPolicy(RolePolicy):
    """`--planner slo` (module docstring)."""

    def _window(self, signals: ClusterSignals) -> list[RecentChoice]:
        window = self.settings.planner_slo_window_s
        return [c for c in signals.recent if c.age_s <= window]

    def _wish_of(self, signals: ClusterSignals) -> Wish | None:
        s = self.settings
        choices = self._window(signals)
        if len(choices) < s.planner_slo_min_requests:
            return None
        slo, target, tight = s.slo, s.planner_slo_attainment, 1.0 - s.planner_slo_slack
        # a met tightened target implies the plain one is met: at most one rule holds
        ttft_missed = ttft_attainment(choices, slo.ttft_s) < target
        itl_missed = itl_attainment(choices, slo.itl_s) < target
        if ttft_missed and itl_attainment(choices, slo.itl_s * tight) >= target:
            return Wish(Role.DECODE, Role.PREFILL, ChangeReason.TTFT_SLO)
        if itl_missed and ttft_attainment(choices, slo.ttft_s * tight) >= target:
            return Wish(Role.PREFILL, Role.DECODE, ChangeReason.ITL_SLO)
        return None

    def _describe(self, signals: ClusterSignals) -> str:
        slo = self.settings.slo
        choices = self._window(signals)
        return (
            f"TTFT attainment {ttft_attainment(choices, slo.ttft_s):.2f} "
            f"(target {slo.ttft_s:g} s), ITL attainment {itl_attainment(choices, slo.itl_s):.2f} "
            f"(target {slo.itl_s:g} s) over {len(choices)} requests, {signals.describe()}"
        )
