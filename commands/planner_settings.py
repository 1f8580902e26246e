"""`PlannerSettings`: the options of `pdserve serve`'s run-time planner, checked once.

`--planner off|load|slo` (default off) turns nodes between prefill and decode while the
deployment serves (commands/role_planner.py and commands/slo_policy.py decide,
commands/role_changer.py acts). Each
field's `option` metadata gives its flag and help; commands/serve_flags.py generates the flags
with these defaults. Thresholds come in high/low pairs (the band between them is the
hysteresis), and every value is bounded here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields

from pdserve.planner.slo import PlanSlo, parse_plan_slo
from pdserve.router.recent_latencies import MAX_ENTRIES, WINDOW_S
from pdserve.wire.config_flags import option


class PlannerMode(enum.StrEnum):
    OFF = "off"
    LOAD = "load"  # prefill queue delay, decode KV usage and queue (commands/role_planner.py)
    SLO = "slo"  # TTFT / TPOT attainment of the recent choices (commands/slo_policy.py)


# field -> (lowest, highest) allowed, both inclusive
BOUNDS: dict[str, tuple[float, float]] = {
    "planner_interval_s": (0.1, 60.0),
    "planner_prefill_delay_high_s": (0.0, 3600.0),
    "planner_prefill_delay_low_s": (0.0, 3600.0),
    "planner_kv_usage_high": (0.0, 1.0),
    "planner_kv_usage_low": (0.0, 1.0),
    "planner_decode_waiting_high": (0.0, 1e6),
    "planner_sustain_s": (0.0, 3600.0),
    "planner_min_dwell_s": (0.0, 86400.0),
    "planner_drain_timeout_s": (1.0, 3600.0),
    "planner_start_timeout_s": (1.0, 3600.0),
    "planner_slo_attainment": (0.01, 1.0),
    "planner_slo_slack": (0.0, 0.9),
    "planner_slo_window_s": (1.0, WINDOW_S),
    "planner_slo_min_requests": (1, MAX_ENTRIES),
}


@dataclass(frozen=True)
class PlannerSettings:
    planner: str = option(
        PlannerMode.OFF.value, flag="--planner", choices=tuple(PlannerMode), group="planner",
        help="turn nodes between prefill and decode at run time: off, load (by the prefill "
        "queue delay and the decode KV usage and queue), slo (by how many recent requests met "
        "--planner-slo)",
    )
    planner_interval_s: float = option(
        2.0, flag="--planner-interval", metavar="SECONDS", group="planner",
        help="how often the planner reads the router's signals",
    )
    planner_prefill_delay_high_s: float = option(
        2.0, flag="--planner-prefill-delay-high", metavar="SECONDS", group="planner",
        help="a prefill queue delay (the largest of the prefill nodes' predicted delays) at or "
        "above this, with decode KV usage at or below --planner-kv-usage-low, turns a decode "
        "node into a prefill node",
    )
    planner_prefill_delay_low_s: float = option(
        0.25, flag="--planner-prefill-delay-low", metavar="SECONDS", group="planner",
        help="prefill counts as idle at or below this queue delay (a prefill node may then "
        "become a decode node)",
    )
    planner_kv_usage_high: float = option(
        0.8, flag="--planner-kv-usage-high", metavar="FRACTION", group="planner",
        help="decode nodes' mean KV usage at or above this, with prefill idle, turns a prefill "
        "node into a decode node",
    )
    planner_kv_usage_low: float = option(
        0.3, flag="--planner-kv-usage-low", metavar="FRACTION", group="planner",
        help="decode nodes' mean KV usage at or below this leaves room to take a decode node",
    )
    planner_decode_waiting_high: float = option(
        8.0, flag="--planner-decode-waiting-high", metavar="REQUESTS", group="planner",
        help="requests waiting per decode node at or above this, with prefill idle, turns a "
        "prefill node into a decode node too",
    )
    planner_sustain_s: float = option(
        4.0, flag="--planner-sustain", metavar="SECONDS", group="planner",
        help="how long a condition must hold, at every reading, before the planner acts on it",
    )
    planner_min_dwell_s: float = option(
        30.0, flag="--planner-min-dwell", metavar="SECONDS", group="planner",
        help="no change within this long of the planner's start or of its last change",
    )
    planner_drain_timeout_s: float = option(
        120.0, flag="--planner-drain-timeout", metavar="SECONDS", group="planner",
        help="how long a node may take to finish its requests; past it the node keeps its role",
    )
    planner_start_timeout_s: float = option(
        300.0, flag="--planner-start-timeout", metavar="SECONDS", group="planner",
        help="how long a node in its new role may take to load and join the router",
    )
    planner_slo: str = option(
        "", flag="--planner-slo", metavar="ttft=SECONDS,itl=SECONDS", group="planner",
        help="with --planner slo: the targets, a request's time to first token and its mean "
        "inter-token latency (TPOT), as `pdserve plan --slo` spells them",
    )
    planner_slo_attainment: float = option(
        0.9, flag="--planner-slo-attainment", metavar="FRACTION", group="planner",
        help="with --planner slo: a target is missed when fewer than this fraction of the "
        "recent requests met it",
    )
    planner_slo_slack: float = option(
        0.2, flag="--planner-slo-slack", metavar="FRACTION", group="planner",
        help="with --planner slo: a role gives up a node only while its own target, tightened "
        "by this fraction, is still met (the hysteresis)",
    )
    planner_slo_window_s: float = option(
        30.0, flag="--planner-slo-window", metavar="SECONDS", group="planner",
        help="with --planner slo: the requests finished within this long count",
    )
    planner_slo_min_requests: int = option(
        10, flag="--planner-slo-min-requests", metavar="N", group="planner",
        help="with --planner slo: no change while fewer requests than this finished within "
        "the window",
    )

    def __post_init__(self) -> None:
        if self.planner not in tuple(PlannerMode):
            raise ValueError(f"planner is {self.planner!r}; expected one of {list(PlannerMode)}")
        if self.planner == PlannerMode.SLO and not self.planner_slo:
            raise ValueError("--planner slo needs its targets: --planner-slo ttft=SECONDS,"
                             "itl=SECONDS")
        if self.planner_slo and self.planner != PlannerMode.SLO:
            raise ValueError(f"--planner-slo sets the targets of --planner slo, not of "
                             f"--planner {self.planner}")
        if self.planner_slo:
            parse_plan_slo(self.planner_slo, flag="--planner-slo")  # fails at start, by name
        for f in fields(self):
            low, high = BOUNDS.get(f.name, (None, None))
            value = getattr(self, f.name)
            if low is not None and not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"{f.name} is {value}; expected {low:g} to {high:g}")
        for high, low in (
            ("planner_prefill_delay_high_s", "planner_prefill_delay_low_s"),
            ("planner_kv_usage_high", "planner_kv_usage_low"),
        ):
            if getattr(self, high) <= getattr(self, low):
                raise ValueError(
                    f"{high} is {getattr(self, high)} and {low} {getattr(self, low)}: the high "
                    "threshold must exceed the low one (the band between them is the hysteresis)"
                )

    @property
    def slo(self) -> PlanSlo:
        """`--planner-slo`, parsed (ValueError naming the part that is wrong)."""
        return parse_plan_slo(self.planner_slo, flag="--planner-slo")

    @property
    def enabled(self) -> bool:
        return self.planner != PlannerMode.OFF
