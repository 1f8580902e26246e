"""How the numba kernels (cpu_decode_attention.py, cpu_gemv.py) run their parallel loops: on
as many threads as torch uses, one kernel at a time per process.

Numba's workqueue threading layer aborts the process when two threads enter a parallel kernel
at once, so one lock serializes them (the engine calls from one thread). Numba's OpenMP layer,
started by its first kernel, sets the process's OpenMP thread count (torch's too) to
NUMBA_NUM_THREADS: torch's own count is given back after the first call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

try:
    import numba
except ImportError:
    numba = None

_ONE_KERNEL_AT_A_TIME = threading.Lock()


def run_parallel(kernel: Callable[..., None], *args: object) -> None:
    """Calls the compiled `kernel` on torch's thread count (within numba's pool)."""
    threads = torch.get_num_threads()
    with _ONE_KERNEL_AT_A_TIME:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        kernel(*args)
