"""Memory bandwidth of this machine as torch sees it (CPU, current thread count).

Three measurements on a buffer far larger than any cache (512 MiB of fp32 by default), each the
best of a few repeats after one warm-up:

* ``copy``: ``dst.copy_(src)``. Reported as *read* bandwidth = bytes of ``src`` / time; the
  memory system actually moves at least twice that (read ``src`` + write ``dst``, plus the
  write-allocate read of ``dst`` on most CPUs).
* ``sum``: ``src.sum()``, a pure streaming read: bytes of ``src`` / time.
* ``gemv``: ``weight @ x`` with ``weight`` [rows, 1024] fp32 - the access pattern of a batch-1
  decode step (every weight read once, tiny vector in and out): bytes of ``weight`` / time.

A decode step of a small model is a sequence of GEMVs over weights that do not fit in cache.
``bench/offline.py`` takes ``weight bytes / copy_read`` as the decode floor (the convention of
the design notes: bandwidth = bytes moved by a copy / 2) and also reports the stricter floor
``weight bytes / best_read``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bandwidth:
    """Read bandwidths in bytes per second (see the module docstring for the conventions)."""

    buffer_bytes: int
    copy_read: float
    sum_read: float
    gemv_read: float

    @property
    def best_read(self) -> float:
        """The highest pure-read bandwidth measured (sum or GEMV)."""
        return max(self.sum_read, self.gemv_read)


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls of fn, after one warm-up call."""
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _copy_time(src: torch.Tensor, repeats: int) -> float:
    dst = torch.zeros_like(src)  # freed on return, before the read-only measurements
    return best_time(lambda: dst.copy_(src), repeats)


@torch.inference_mode()
def measure_bandwidth(buffer_mib: int = 512, repeats: int = 5) -> Bandwidth:
    """Measures copy/sum/gemv read bandwidth with torch's current thread count."""
    numel = buffer_mib * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32)
    nbytes = src.numel() * src.element_size()
    copy_s = _copy_time(src, repeats)
    sum_s = best_time(lambda: src.sum(), repeats)
    weight = src.view(-1, 1024)
    x = torch.ones(1024, dtype=torch.float32)
    gemv_s = best_time(lambda: torch.mv(weight, x), repeats)
    return Bandwidth(
        buffer_bytes=nbytes,
        copy_read=nbytes / copy_s,
        sum_read=nbytes / sum_s,
        gemv_read=nbytes / gemv_s,
    )


if __name__ == "__main__":
    bw = measure_bandwidth()
    print(
        f"threads={torch.get_num_threads()} copy(read)={bw.copy_read / 1e9:.1f} GB/s "
        f"sum={bw.sum_read / 1e9:.1f} GB/s gemv={bw.gemv_read / 1e9:.1f} GB/s"
    )
