"""When each benchmark request is sent: offsets in seconds from the start of the run.

Inter-arrival gaps are Gamma-distributed with shape `burstiness` and mean 1 / rate. Shape 1 is
the exponential distribution, i.e. Poisson arrivals; a shape below 1 makes the traffic burstier
(clusters of requests and long quiet gaps), above 1 more regular. A rate of infinity sends
every request at once.
"""

from __future__ import annotations

import math
import random

ARRIVALS = ("poisson", "gamma")


def check_arrival(arrival: str, rate: float, burstiness: float) -> None:
    if arrival not in ARRIVALS:
        raise ValueError(f"--arrival is {arrival!r}; expected one of {', '.join(ARRIVALS)}")
    if not rate > 0:
        raise ValueError(f"--request-rate is {rate}; expected a positive number or inf")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness is {burstiness}; expected a positive number")
    if arrival == "poisson" and burstiness != 1.0:
        raise ValueError(
            f"--burstiness {burstiness} needs --arrival gamma (Poisson arrivals have shape 1.0)"
        )


def arrival_times(
    count: int,
    rate: float,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int | str = 0,
) -> list[float]:
    """`count` send offsets, the first at 0 s, each gap drawn from Gamma(burstiness, mean 1/rate)."""
    check_arrival(arrival, rate, burstiness)
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{seed}")
    scale = 1.0 / (rate * burstiness)
    times, at = [], 0.0
    for _ in range(count):
        times.append(at)
        at += rng.gammavariate(burstiness, scale)
    return times


def trace_times(timestamps_ms: list[float], speedup: float = 1.0) -> list[float]:
    """A trace's millisecond timestamps as send offsets from its first request, `speedup` times
    faster than recorded."""
    if not speedup > 0:
        raise ValueError(f"--trace-speedup is {speedup}; expected a positive number")
    if not timestamps_ms:
        return []
    first = min(timestamps_ms)
    return [(t - first) / 1000.0 / speedup for t in timestamps_ms]
