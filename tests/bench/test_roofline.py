"""The batch-1 decode roofline of bench/offline.py: weight bytes over the READ bandwidth, the
better of the streaming sum and the GEMV, and the 60% goal line measured against it."""

from __future__ import annotations

import pytest

from pdserve.bench.bandwidth import Bandwidth, ReadRoofline, measure_bandwidth
from pdserve.bench.decode_b1 import DecodeTiming
from pdserve.bench.report import TARGET_ROOFLINE_FRACTION, decode_section

SUM_FASTER = Bandwidth(buffer_bytes=2**29, sum_read=40e9, gemv_read=20e9)
GEMV_FASTER = Bandwidth(buffer_bytes=2**29, sum_read=20e9, gemv_read=25e9)


def test_the_floor_is_weight_bytes_over_the_better_read_bandwidth():
    assert ReadRoofline(400_000_000, SUM_FASTER).floor_s == pytest.approx(0.010)
    assert ReadRoofline(400_000_000, GEMV_FASTER).floor_s == pytest.approx(0.016)


def test_a_step_meets_the_goal_at_60_percent_of_the_read_roofline():
    roofline = ReadRoofline(400_000_000, SUM_FASTER)  # 10 ms floor
    assert TARGET_ROOFLINE_FRACTION == 0.60
    assert roofline.fraction(0.016) == pytest.approx(0.625)
    assert roofline.meets(0.016, TARGET_ROOFLINE_FRACTION)
    assert not roofline.meets(0.017, TARGET_ROOFLINE_FRACTION)


def test_two_runs_keep_the_better_of_each_measurement():
    best = SUM_FASTER.best_of(GEMV_FASTER)
    assert (best.sum_read, best.gemv_read, best.read) == (40e9, 25e9, 40e9)


def test_the_report_states_both_reads_the_roofline_and_the_verdict():
    timing = DecodeTiming(32, step_s=[0.016] * 3, forward_s=[0.015] * 3, linears_s=0.012)
    text = decode_section(timing, 400_000_000, SUM_FASTER)
    assert "40.0 GB/s" in text and "20.0 GB/s" in text
    assert "**10.0 ms** (40.0 GB/s)" in text
    assert "**62%** (target >= 60%: met)" in text
    assert "copy" not in text


def test_a_small_measurement_reads_at_a_plausible_rate():
    bandwidth = measure_bandwidth(buffer_mib=8, repeats=1)
    assert bandwidth.buffer_bytes == 8 * 2**20
    assert 1e8 < bandwidth.sum_read < 1e13 and 1e8 < bandwidth.gemv_read < 1e13


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("float32", "int8")]
)
def test_the_linears_alone_are_timed_in_the_models_dtype(tmp_path, dtype, quantization):
    from pdserve.bench.decode_b1 import time_linears_b1
    from pdserve.engine.llm import LLM
    from pdserve.testing.tiny_models import save_tiny_model

    llm = LLM(str(save_tiny_model("llama", tmp_path)), dtype=dtype, num_kv_blocks=16,
              quantization=quantization)
    assert 0 < time_linears_b1(llm.engine.runner.model) < 10
