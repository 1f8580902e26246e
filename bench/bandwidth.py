"""Memory READ bandwidth of this machine as torch sees it (CPU, current thread count), and the
batch-1 decode roofline it gives.

Two measurements over a buffer far larger than any cache (512 MiB of fp32 by default), each the
best of a few repeats after one warm-up:

* ``sum``: ``src.sum()``, a pure streaming read: bytes of ``src`` / time.
* ``gemv``: ``weight @ x`` with ``weight`` [rows, 1024] fp32 over the same 512 MiB - the access
  pattern of a batch-1 decode step (every weight read once, a tiny vector in and out): bytes of
  ``weight`` / time.

A batch-1 decode step of a small model is a sequence of GEMVs over weights that do not fit in
cache, so it cannot take less than ``weight bytes / read bandwidth``; the read bandwidth is the
better of the two measurements (`Bandwidth.read`), the most this machine was seen to read.
A copy is no read measurement: it also writes (and on most CPUs reads the destination before
writing it), so ``bytes / 2`` of a copy undercounts what the memory system can deliver to a
read-only kernel, and a floor built on it is too lenient.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

GEMV_COLUMNS = 1024


@dataclass(frozen=True)
class Bandwidth:
    """Read bandwidths in bytes per second, over a `buffer_bytes` buffer."""

    buffer_bytes: int
    sum_read: float
    gemv_read: float

    @property
    def read(self) -> float:
        """The read bandwidth of the roofline: the better of the streaming sum and the GEMV."""
        return max(self.sum_read, self.gemv_read)

    def best_of(self, other: Bandwidth) -> Bandwidth:
        """Per measurement, the better of two runs (a VM's bandwidth drifts over time)."""
        return Bandwidth(
            buffer_bytes=self.buffer_bytes,
            sum_read=max(self.sum_read, other.sum_read),
            gemv_read=max(self.gemv_read, other.gemv_read),
        )


@dataclass(frozen=True)
class ReadRoofline:
    """Batch-1 decode against the read roofline: a step streams `weight_bytes` at least once."""

    weight_bytes: int
    bandwidth: Bandwidth

    @property
    def floor_s(self) -> float:
        """The least time a batch-1 step can take: weight bytes / read bandwidth."""
        return self.weight_bytes / self.bandwidth.read

    def fraction(self, step_s: float) -> float:
        """How close a step of `step_s` seconds comes to the roofline (1.0: at the floor)."""
        return self.floor_s / step_s

    def meets(self, step_s: float, target: float) -> bool:
        return self.fraction(step_s) >= target


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls of fn, after one warm-up call."""
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_bandwidth(buffer_mib: int = 512, repeats: int = 5) -> Bandwidth:
    """Measures sum and GEMV read bandwidth with torch's current thread count."""
    numel = buffer_mib * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32)
    nbytes = src.numel() * src.element_size()
    sum_s = best_time(lambda: src.sum(), repeats)
    weight = src.view(-1, GEMV_COLUMNS)
    x = torch.ones(GEMV_COLUMNS, dtype=torch.float32)
    gemv_s = best_time(lambda: torch.mv(weight, x), repeats)
    return Bandwidth(buffer_bytes=nbytes, sum_read=nbytes / sum_s, gemv_read=nbytes / gemv_s)


if __name__ == "__main__":
    bw = measure_bandwidth()
    print(
        f"threads={torch.get_num_threads()} sum={bw.sum_read / 1e9:.1f} GB/s "
        f"gemv={bw.gemv_read / 1e9:.1f} GB/s read={bw.read / 1e9:.1f} GB/s"
    )
