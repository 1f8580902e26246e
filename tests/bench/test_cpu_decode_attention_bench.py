"""The CPU decode attention benchmark's pieces on a tiny case: both paths time and agree, and the
report names both sides and their ratio (the engine part needs the default model: not here)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench import cpu_decode_attention as bench
from pdserve.kernels import cpu_decode_attention as kernel_module


@pytest.mark.skipif(kernel_module.numba is None, reason="numba is not installed")
def test_layer_calls_are_timed_side_by_side_and_agree():
    old, new, difference = bench.time_layer_calls(2, [17, 40], torch.float32, 0, 0.0)
    assert old > 0 and new > 0
    assert difference < 1e-5


def test_report_shows_both_paths_and_the_ratio():
    class Args:
        min_seconds, dtype, step_batch, prompt_len, repeats, steps = 0.5, "float32", 64, 128, 2, 8

    machine = {
        "cpu": "a CPU", "cores": "2 usable", "torch": "2.x", "date": "today",
        "load average at start": "0.10", "load average at end": "0.20",
    }
    text = bench.build_report(
        Args, machine, [("float32", 64, "128", 0.002, 0.001, 1e-7)], [("float32", 3.0, 0.2)],
        [("old", 0.2, 0.4, 146), ("new", 0.16, 0.25, 146)], "0.68, threading layer omp",
    )
    assert "| float32 | 64 | 128 | 2.000 ms | 1.000 ms | 2.00x | 1.0e-07 |" in text
    assert "| old (gather) | 200.0 ms | 40.0% |" in text
    assert "Step time old / new: 1.25x." in text
