"""The int8 weight-only linear (kernels/cpu_int8_linear.py for one token, the panels of
kernels/cpu_panel_linear.py for more, engine/layers/int8_weight.py choosing) against its torch
reference: one token, a few, a prefill chunk, row counts that fill no whole panel, with and
without a bias; and the quantization itself (scales, range, rounding error, zero rows).
tests/kernels/test_instruction_sets.py runs this file again with numba compiling for other
instruction sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.layers.int8_weight import QMAX, Int8Weight
from pdserve.engine.layers.linear import Linear
from pdserve.kernels.cpu_int8_linear import int8_kernel_available, int8_linear, reference

pytestmark = pytest.mark.skipif(not int8_kernel_available(), reason="needs numba")


def quantized(rows: int, columns: int, seed: int) -> Int8Weight:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator)
    bias = torch.randn(rows, generator=generator)
    return Int8Weight.quantize(weight, bias)


@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 17, 130])  # 0: a step that samples no row
@pytest.mark.parametrize("rows,columns", [(8, 64), (13, 96), (962, 576), (5, 1536)])
def test_the_kernels_equal_the_torch_reference(tokens, rows, columns):
    weight = quantized(rows, columns, seed=rows * 1000 + tokens)
    x = torch.randn(tokens, columns, generator=torch.Generator().manual_seed(tokens))
    # only the order of the fp32 sums differs: a few ulps of the largest partial sums
    magnitude = x.abs() @ weight.dequantized().abs().T
    tolerance = 1e-5 * float(magnitude.max()) if tokens else 0.0
    expected = reference(weight.quantized, weight.scale, x, weight.bias)
    assert weight.panels is not None  # the engine's path for two tokens and more
    got = weight(x)
    assert got.shape == (tokens, rows)
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)
    if tokens == 1:  # the row-major loop, which the compiled one-token step runs too
        for bias in (weight.bias, None):
            expected = reference(weight.quantized, weight.scale, x, bias)
            words = np.zeros(0, np.float32) if bias is None else bias.numpy()
            got = int8_linear(weight.quantized.numpy(), weight.scale.numpy(), x, words)
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)


def test_the_row_major_loop_refuses_more_than_one_token():
    weight = quantized(8, 64, seed=0)
    with pytest.raises(ValueError, match="one token"):
        int8_linear(weight.quantized.numpy(), weight.scale.numpy(), torch.ones(2, 64),
                    np.zeros(0, np.float32))


def test_quantization_keeps_every_row_within_half_a_step_with_one_scale_per_row():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=generator) * torch.logspace(-3, 2, 64)[:, None]
    weight[7] = 0.0  # a row of zeros gets scale 1 and stays zeros
    int8 = Int8Weight.quantize(weight, None)
    assert int8.quantized.dtype == torch.int8 and int8.scale.shape == (64,)
    assert int(int8.quantized.abs().max()) == QMAX
    assert int8.scale[7] == 1.0 and not int8.quantized[7].any()
    error = (int8.dequantized() - weight).abs()
    assert bool((error <= int8.scale[:, None] / 2 * (1 + 1e-6)).all())
    # each nonzero row's largest element is exact up to fp32 rounding, whatever its magnitude
    largest = weight.abs().amax(dim=1)
    assert torch.allclose(int8.dequantized().abs().amax(dim=1), largest, rtol=1e-6)
    assert int8.num_bytes == 64 * 256 + 64 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_packed_as_int8_answers_in_its_input_dtype_for_any_leading_shape(dtype):
    linear = Linear(96, 40, bias=True, dtype=dtype)
    linear.load("weight", torch.randn(40, 96).to(dtype))
    linear.load("bias", torch.randn(40).to(dtype))
    exact = linear.weight.data.float().clone()
    linear.pack("int8")
    assert linear.weight is None and linear.quantized is not None
    assert linear.weight_bytes == 40 * 96 + 40 * 4 + 40 * 4
    x = torch.randn(3, 5, 96).to(dtype)
    y = linear(x)
    assert y.dtype == dtype and y.shape == (3, 5, 40)
    expected = torch.nn.functional.linear(x.float(), exact, linear.bias.detach().float())
    # int8's rounding: at most half a step per weight, summed over 96 inputs
    bound = float((x.float().abs() @ (linear.quantized.scale[:, None] / 2).expand(40, 96).T).max())
    rounding = 1e-4 if dtype == torch.float32 else float(expected.abs().max()) * 2**-8  # bf16 out
    assert float((y.float() - expected).abs().max()) <= bound + rounding
    with pytest.raises(ValueError, match="quantization must be one of"):
        Linear(8, 8, bias=False).pack("int2")


def fresh_assembly(kernel) -> str:
    """The machine code of an int8 kernel compiled afresh on a small weight (a kernel loaded
    from numba's cache has no assembly)."""
    import numba

    fresh = numba.njit(parallel=True, fastmath=True)(kernel.py_func)
    weight, scale = np.ones((8, 64), np.int8), np.ones(8, np.float32)
    x, out = np.ones((2, 64), np.float32), np.empty((2, 8), np.float32)
    fresh(weight, scale, x, np.zeros(0, np.float32), out, 2)
    return "".join(fresh.inspect_asm().values())


def test_the_kernels_use_the_vectors_numba_compiles_for_and_no_wider():
    """The instruction set numba targets (the host's, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES
    as tests/kernels/test_instruction_sets.py sets them) decides the registers: 256-bit ones
    where AVX2 is targeted, never 512-bit ones where AVX-512 is not, no 256-bit ones on the
    x86-64 baseline. Compiled afresh (a kernel loaded from numba's cache has no assembly)."""
    import platform

    import numba
    from llvmlite import binding

    from pdserve.kernels import cpu_int8_linear

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 registers")
    if numba.config.CPU_NAME == "generic":
        targeted = set()
    elif numba.config.CPU_FEATURES is not None:
        targeted = {f[1:] for f in numba.config.CPU_FEATURES.split(",") if f.startswith("+")}
    else:
        targeted = {name for name, on in binding.get_host_cpu_features().items() if on}
    assembly = fresh_assembly(cpu_int8_linear.one_token_kernel)
    assert ("%zmm" in assembly) <= ("avx512f" in targeted)
    assert ("%ymm" in assembly) == ("avx2" in targeted or "avx512f" in targeted)


def test_the_one_token_loop_asks_for_its_rows_ahead():
    """The one-token loop's prefetch (PREFETCH_BYTES) is in its machine code, whatever the
    instruction set (x86's prefetcht0, ARM's prfm)."""
    from pdserve.kernels import cpu_int8_linear

    assembly = fresh_assembly(cpu_int8_linear.one_token_kernel)
    assert "prefetcht0" in assembly or "prfm" in assembly
