"""The 4-bit linear (kernels/cpu_int4_linear.py): its rounding (4-bit values in range, a weight
within half a step of what it stands for, fp16 scales and minimums; weights beyond fp16 refused),
the packing's layout, every finite fp16 minimum widened exactly, the kernel against its torch
reference for every block of tokens it has a path for (none, one to four tokens, several blocks
and a remainder, more than a pass), rows that fill no whole panel and inputs that fill no whole
group, with and without a bias; how far rounding the inputs to
int8 moves a product; and the machine code of its chunks. tests/kernels/test_instruction_sets.py
runs this file again with numba compiling for other instruction sets (AVX2: vpmaddubsw; the
x86-64 baseline: the products written out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers.int4_weight import Int4Weight
from pdserve.kernels.cpu_int4_linear import (
    GROUP,
    GROUP_BYTES,
    QUANT_BYTES,
    dequantize,
    int4_kernel_available,
    int4_linear,
    pack,
    quantize,
    quantize_inputs,
    reference,
)

NO_BIAS = np.zeros(0, np.float32)


def test_rounding_keeps_each_weight_within_half_a_step_of_what_it_stands_for():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 70, generator=generator)  # 70 inputs: the last group has 6
    weight[3, :32] = 0.5  # a group of equal weights
    q, scale, minimum = quantize(weight)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == minimum.shape == (40, 3)
    assert torch.equal(scale, scale.to(torch.float16).float())  # fp16 values
    assert scale[3, 0] == 0 and minimum[3, 0] == 0.5 and not q[3, :32].any()
    step = scale.repeat_interleave(GROUP, dim=1)[:, :70]
    error = (dequantize(q, scale, minimum) - weight).abs()
    # half a step, and the fp16 rounding of the minimum (a 2,048th of it at most)
    bound = step / 2 + minimum.abs().repeat_interleave(GROUP, dim=1)[:, :70] / 2048 + 1e-6
    assert (error <= bound).all()
    assert float(error.max()) > 0.01, "nothing was rounded: are the weights quantized?"


def test_packing_puts_four_inputs_of_sixteen_rows_in_each_32_byte_chunk():
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (21, 40), dtype=torch.uint8, generator=generator)
    scale = torch.rand(21, 2) + 0.5
    minimum = -torch.rand(21, 2)
    panels = pack(q, scale, minimum)
    assert panels.shape == (2, 2, GROUP_BYTES) and panels.dtype == torch.uint8
    cases = ((0, 0, 0, 0, 0), (0, 1, 1, 7, 1), (1, 0, 7, 4, 3), (0, 0, 2, 2, 2))
    for panel, group, chunk, row, j in cases:
        byte = int(panels[panel, group, chunk * 32 + 4 * row + j])
        column = group * GROUP + chunk * 4 + j
        assert byte & 0x0F == q[panel * 16 + row, column]
        high_row = panel * 16 + 8 + row
        assert byte >> 4 == (q[high_row, column] if high_row < 21 else 0)
    scales = panels[0, 1, QUANT_BYTES : QUANT_BYTES + 32].view(torch.float16).float()
    minimums = panels[0, 1, QUANT_BYTES + 32 :].view(torch.float16).float()
    assert torch.equal(scales, scale[:16, 1].to(torch.float16).float())
    assert torch.equal(minimums, minimum[:16, 1].to(torch.float16).float())
    padded = panels[1, 1]  # rows 21..31 and inputs 40..63 are padding: zeros
    assert not padded[QUANT_BYTES + 2 * 5 : QUANT_BYTES + 32].any()
    assert not panels[1, 1, 3 * 32 :QUANT_BYTES].any()


@pytest.mark.parametrize("bad", [-70000.0, 1e6, float("inf"), float("nan")])
def test_weights_whose_minimum_or_step_fp16_cannot_hold_are_refused(bad):
    weight = torch.zeros(2, 32)
    weight[1, 5] = bad
    with pytest.raises(ValueError, match="fp16"):
        quantize(weight)


@pytest.mark.skipif(not int4_kernel_available(), reason="needs numba")
def test_every_finite_fp16_minimum_is_widened_exactly():
    """Zero 4-bit values and one input of 1.0: each row's output is its minimum times 1, so the
    kernel's widening of every finite fp16 value (subnormals, zeros, the largest) shows."""
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    minimums = codes[torch.isfinite(codes)].float()[:, None]  # [63,488, 1]
    q = torch.zeros(len(minimums), GROUP, dtype=torch.uint8)
    panels = pack(q, torch.zeros_like(minimums), minimums)
    x = torch.zeros(1, GROUP)
    x[0, 0] = 1.0
    got = int4_linear(panels.numpy(), x, NO_BIAS, len(minimums))
    assert torch.equal(got[0], minimums[:, 0])


@pytest.mark.skipif(not int4_kernel_available(), reason="needs numba")
@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 4, 5, 9, 16, 61, 130])
@pytest.mark.parametrize("rows,columns", [(16, 32), (5, 64), (53, 70), (960, 576), (32, 1536)])
def test_the_kernel_equals_the_torch_reference(tokens, rows, columns):
    generator = torch.Generator().manual_seed(rows * 1000 + tokens)
    weight = torch.randn(rows, columns, generator=generator) * 0.05
    bias = torch.randn(rows, generator=generator)
    x = torch.randn(tokens, columns, generator=generator)
    q, scale, minimum = quantize(weight)
    panels = pack(q, scale, minimum).numpy()
    for b in (bias, None):
        expected = reference(q, scale, minimum, x, b)
        got = int4_linear(panels, x, NO_BIAS if b is None else b.numpy(), rows)
        assert got.shape == (tokens, rows)
        # integer sums are exact; the fp32 epilogue's order differs: ulps of its terms
        magnitude = x.abs() @ dequantize(q, scale, minimum).abs().T
        tolerance = 1e-5 * float(magnitude.max()) if tokens else 0.0
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)


def test_rounding_the_inputs_to_int8_moves_a_product_less_than_the_weights_rounding():
    """Measured: 0.12x the weights' error on normal inputs, 0.19x with an outlier 40 sigma out
    in every token (its group's other inputs keep 1/254 of it)."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(256, 576, generator=generator) * 0.05
    q, scale, minimum = quantize(weight)
    for outlier, bound in ((None, 0.3), (40.0, 0.5)):
        x = torch.randn(8, 576, generator=generator)
        if outlier is not None:
            x[:, 7] = outlier
        exact = F.linear(x, weight)
        weight_only = F.linear(x, dequantize(q, scale, minimum))
        both = reference(q, scale, minimum, x, None)
        weight_error = float((weight_only - exact).norm() / exact.norm())
        input_error = float((both - weight_only).norm() / exact.norm())
        assert 0.01 < weight_error < 0.2, weight_error
        assert 0 < input_error < bound * weight_error, (outlier, input_error, weight_error)
    x8, input_scale, sums = quantize_inputs(x)
    assert int(x8[:, 7].abs().min()) == 127 and torch.allclose(sums[:, 0], x[:, :32].sum(1))
    assert torch.allclose(input_scale[:, 0], x[:, :32].abs().amax(1) / 127)


@pytest.mark.skipif(not int4_kernel_available(), reason="needs numba")
def test_the_layer_reads_fewer_bytes_than_int8_and_multiplies_through_the_kernel():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator)
    layer = Int4Weight.quantize(weight, bias)
    assert layer.num_bytes == 6 * 2 * GROUP_BYTES + 96 * 4  # 5 bits a weight, and the bias
    x = torch.randn(3, 64, generator=generator, dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 96)
    expected = reference(*quantize(weight), x.float(), bias)
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.01)


@pytest.mark.skipif(not int4_kernel_available(), reason="needs numba")
def test_the_chunks_multiply_in_integers_where_the_cpu_can():
    """Compiled afresh (a kernel loaded from numba's cache has no assembly) for the instruction
    set numba targets: on x86 with AVX2, vpmaddubsw; on the x86-64 baseline, 16-bit multiplies
    (pmullw). Elsewhere only the results are checked (above)."""
    import platform

    import numba

    from pdserve.kernels import cpu_int4_linear

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instructions")
    fresh = numba.njit(parallel=True)(cpu_int4_linear.int4_kernel.py_func)
    panels = pack(*quantize(torch.ones(16, 64))).numpy()
    out = np.empty((4, 16), np.float32)
    fresh(panels, np.ones((4, 64), np.float32), NO_BIAS, out, 1)
    assembly = "".join(fresh.inspect_asm().values())
    if cpu_int4_linear._TARGET_HAS_AVX2:
        assert "vpmaddubsw" in assembly
    else:
        assert "pmullw" in assembly and "pmaddubsw" not in assembly
