"""What a request must meet to count toward goodput, and a simulated run's numbers.

`--slo ttft=SECONDS,itl=SECONDS`: both parts, each in (0, 3600] seconds. `itl` bounds the
request's mean inter-token latency (its TPOT: (last token - first token) / (tokens - 1)), the
bound bench/goodput.py measures real runs against, so a plan and a measured run count the
same requests as good. Percentiles take the nearest rank, as bench/serve_metrics.py does.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from pdserve.bench.serve_metrics import percentile
from pdserve.planner.simulator import RequestOutcome

SLO_PARTS = ("ttft", "itl")
MAX_SLO_S = 3600.0


@dataclass(frozen=True)
class PlanSlo:
    ttft_s: float
    itl_s: float

    def met_by(self, outcome: RequestOutcome) -> bool:
        return outcome.ttft <= self.ttft_s and outcome.tpot <= self.itl_s


def parse_plan_slo(text: str, flag: str = "--slo") -> PlanSlo:
    """`text` as `ttft=SECONDS,itl=SECONDS`; ValueError naming `flag` and the part that is
    wrong."""
    values: dict[str, float] = {}
    for part in text.split(","):
        name, sep, number = part.strip().partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_PARTS:
            raise ValueError(f"{flag} part {part.strip()!r} is not NAME=SECONDS; expected "
                             f"ttft=SECONDS,itl=SECONDS, e.g. {flag} ttft=2,itl=0.2")
        if name in values:
            raise ValueError(f"{flag} gives {name} twice")
        try:
            seconds = float(number)
        except ValueError:
            raise ValueError(f"{flag} {name} is {number.strip()!r}; expected seconds") from None
        if not (0 < seconds <= MAX_SLO_S and math.isfinite(seconds)):
            raise ValueError(
                f"{flag} {name} is {seconds:g}; expected seconds in (0, {MAX_SLO_S:g}]"
            )
        values[name] = seconds
    missing = [name for name in SLO_PARTS if name not in values]
    if missing:
        raise ValueError(f"{flag} lacks {', '.join(missing)}; expected ttft=SECONDS,itl=SECONDS")
    return PlanSlo(values["ttft"], values["itl"])


@dataclass(frozen=True)
class SimSummary:
    requests: int
    good: int
    wall_s: float  # from the first arrival to the last token
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    placements: dict[str, int]

    @property
    def goodput(self) -> float:
        return self.good / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def attainment(self) -> float:
        return self.good / self.requests if self.requests else 0.0


def summarize(outcomes: list[RequestOutcome], slo: PlanSlo) -> SimSummary:
    start = min(o.request.arrival_s for o in outcomes)
    ttfts = [o.ttft for o in outcomes]
    itls = [gap for o in outcomes for gap in o.itls]
    return SimSummary(
        requests=len(outcomes),
        good=sum(slo.met_by(o) for o in outcomes),
        wall_s=max(o.finished_s for o in outcomes) - start,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        placements=dict(Counter(o.placement.value for o in outcomes)),
    )
