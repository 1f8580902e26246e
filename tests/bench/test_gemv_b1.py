"""bench/gemv_b1.py: the weight shapes of a decode step, kernels that all compute the same
product, and a report whose rates follow from the timings."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from pdserve.bench.bandwidth import Bandwidth
from pdserve.bench.gemv_b1 import build_report, kernels, measure, model_shapes

SMOLLM2_135M = {
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152,
}


def test_the_shapes_are_every_linear_of_a_step_and_the_head():
    shapes = model_shapes(SMOLLM2_135M)
    assert len(shapes) == 4 * 30 + 1
    assert shapes[:4] == [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    assert shapes[-1] == (49152, 576)
    # SmolLM2-135M has 134,515,008 parameters: these and 61 norms of 576 (the embedding is
    # tied to the head).
    assert sum(o * i for o, i in shapes) == 134_515_008 - 61 * 576


@pytest.mark.parametrize("kernel", kernels(), ids=lambda k: f"{k.dtype}-{k.name}")
def test_every_kernel_computes_the_product(kernel):
    weight = torch.randn(96, 64) * 0.1
    x = torch.randn(1, 64)
    given = kernel.input_dtype
    expected = F.linear(x.to(given).float(), weight.to(given).float())
    got = kernel.call(x.to(given), kernel.prepare(weight.to(given)))
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}.get(kernel.dtype, 6e-2)  # int8
    torch.testing.assert_close(got.float().reshape(1, -1), expected, atol=tolerance, rtol=0)


def test_report_rates_follow_from_the_round_times():
    shapes = [(64, 32), (32, 64)]
    timings = measure(shapes, rounds=1, seed=0)
    assert [k.name for k, _ in timings] == [k.name for k in kernels()]
    assert all(0 < seconds < 10 for _, seconds in timings)
    fake = [(timings[0][0], 4096 * 4 / 1e9)]  # 4,096 fp32 parameters in 1 us per byte-GB
    bandwidth = Bandwidth(buffer_bytes=1, sum_read=2e9, gemv_read=1e9)
    text = build_report(argparse.Namespace(rounds=1), {"cpu": "x"}, "m", shapes, bandwidth, fake)
    assert "| float32 | F.linear | 0.02 | 0 | 1.0 | 50% | 0.01 |" in text
