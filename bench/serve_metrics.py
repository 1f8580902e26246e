"""The serving benchmark's statistics: latency percentiles, request and token throughput, and
goodput under a latency SLO.

TTFT: send to the first chunk with text. ITL: the gaps between chunks with text. TPOT: per
request, (E2E - TTFT) / (output tokens - 1). Goodput: completed requests per second that met
every SLO part given; SLO attainment: the fraction of all requests (failed ones included) that
did. Percentiles take the nearest rank.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.bench.serve_load import RequestTiming

LATENCIES = ("ttft", "tpot", "itl", "e2e")
QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, timing: RequestTiming) -> bool:
        return (self.ttft_s is None or timing.ttft <= self.ttft_s) and (
            self.tpot_s is None or timing.tpot <= self.tpot_s
        )

    def describe(self) -> str:
        parts = [
            f"{name} <= {value * 1000:g} ms"
            for name, value in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s))
            if value is not None
        ]
        return " and ".join(parts) or "none (every completed request counts)"


def parse_slo(text: str | None) -> Slo:
    """`ttft:MS,tpot:MS`, either part optional, e.g. `ttft:500` or `tpot:50,ttft:2000`."""
    if text is None or not text.strip():
        return Slo()
    values: dict[str, float] = {}
    for part in text.split(","):
        name, sep, number = part.strip().partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot"):
            raise ValueError(
                f"--slo part {part.strip()!r} is not NAME:MS; expected ttft:MS and/or tpot:MS, "
                "e.g. --slo ttft:500,tpot:50"
            )
        if name in values:
            raise ValueError(f"--slo gives {name} twice in {text!r}")
        try:
            ms = float(number)
        except ValueError:
            raise ValueError(
                f"--slo {name} is {number.strip()!r}; expected milliseconds, e.g. {name}:500"
            ) from None
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"--slo {name} is {ms:g} ms; expected a positive number")
        values[name] = ms / 1000.0
    return Slo(values.get("ttft"), values.get("tpot"))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _spread(name: str, values: list[float]) -> dict[str, float]:
    out = {f"{name}_mean": statistics.fmean(values) if values else float("nan")}
    for q in QUANTILES:
        out[f"{name}_p{q}"] = percentile(values, q)
    out[f"{name}_max"] = max(values, default=float("nan"))
    return out


def summarize(
    timings: list[RequestTiming],
    wall: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict[str, float]:
    """Every metric of one run; latencies in seconds, SLO bounds in seconds (None: no bound)."""
    slo = Slo(slo_ttft, slo_tpot)
    done = [t for t in timings if t.ok]
    good = [t for t in done if slo.met_by(t)]
    input_tokens = sum(t.prompt_tokens for t in done)
    output_tokens = sum(t.output_tokens for t in done)
    wall = wall if wall > 0 else float("nan")
    out = {
        "requests": len(timings),
        "completed": len(done),
        "failed": len(timings) - len(done),
        "duration_s": wall,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / wall,
        "throughput_tok_s": output_tokens / wall,
        "total_throughput_tok_s": (input_tokens + output_tokens) / wall,
        "goodput": len(good) / wall,
        "slo_attainment": len(good) / len(timings) if timings else 0.0,
    }
    for name, values in (
        ("ttft", [t.ttft for t in done]),
        ("tpot", [t.tpot for t in done if t.output_tokens > 1]),
        ("itl", [x for t in done for x in t.itls]),
        ("e2e", [t.e2e for t in done]),
    ):
        out.update(_spread(name, values))
    return out
