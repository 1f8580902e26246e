"""bench/linear_batches.py: every kernel it times computes the same product, and the report's
ratios follow from the timings."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from pdserve.bench.linear_batches import KERNELS, build_report, measure
from pdserve.kernels.cpu_panel_linear import panel_kernel_available

pytestmark = pytest.mark.skipif(not panel_kernel_available(), reason="needs numba")


@pytest.mark.parametrize("dtype,kernel", KERNELS, ids=lambda k: getattr(k, "name", k))
@pytest.mark.parametrize("tokens", [1, 7])
def test_every_kernel_computes_the_product(dtype, kernel, tokens):
    weight = torch.randn(96, 64) * 0.1
    x = torch.randn(tokens, 64)
    expected = F.linear(x, weight)
    got = kernel.call(x, kernel.prepare(weight))
    # half a step per weight, 64 of them: int8's step about 0.4 / 127, int4's 0.6 / 15
    tolerance = {"fp32": 1e-5, "int8": 0.1, "int4": 1.0}[dtype]
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0)


def test_report_rates_and_ratios_follow_from_the_round_times():
    shapes = [(64, 32), (32, 64)]
    best = measure(shapes, (2,), rounds=1, seed=0)
    assert len(best) == len(KERNELS) and all(0 < s < 10 for s in best.values())
    fake = {key: 1e-3 for key in best}
    fake[("fp32", "oneDNN prepacked", 2)] = 2e-3  # both panels twice as fast
    fake[("int8", "pdserve panels", 2)] = 0.5e-3  # int8's four times
    text = build_report(argparse.Namespace(rounds=1), {"cpu": "x"}, "m", shapes, (2,), fake)
    # 4,096 parameters x 2 tokens x 2 operations in 1 ms: 0.016 GF/s, printed as 0
    assert "| 2 | 2.0 (0) | 1.0 (0) | 0.5 (0) | 1.0 (0) | 2.00x | 4.00x | 2.00x |" in text
