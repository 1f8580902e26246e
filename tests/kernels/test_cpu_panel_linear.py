"""The panel linear (kernels/cpu_panel_linear.py) against its torch reference: fp32 and int8
weights, every block of tokens the kernel has a path for (none, one to six tokens, several
blocks and a remainder, a prefill chunk), one panel and many, rows that fill no whole panel, with and
without a bias; the packing's layout; and the machine code of its six-token block. tests/kernels/test_instruction_sets.py
runs this file again with numba compiling for other instruction sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.layers.int8_weight import Int8Weight
from pdserve.kernels.cpu_int8_linear import reference
from pdserve.kernels.cpu_panel_linear import (
    PANEL_ROWS,
    pack_panels,
    panel_kernel_available,
    panel_linear,
)

pytestmark = pytest.mark.skipif(not panel_kernel_available(), reason="needs numba")
NO_BIAS = np.zeros(0, np.float32)


def test_packing_puts_each_panels_sixteen_rows_of_one_input_side_by_side():
    weight = torch.arange(32 * 5, dtype=torch.float32).reshape(32, 5)
    panels = pack_panels(weight)
    assert panels.shape == (2, 5, PANEL_ROWS) and panels.is_contiguous()
    for panel in range(2):
        for i in range(5):
            assert torch.equal(panels[panel, i], weight[panel * 16 : (panel + 1) * 16, i])
    padded = pack_panels(weight[:21])  # one panel and five rows: the rest of it zeros
    assert padded.shape == (2, 5, PANEL_ROWS)
    assert torch.equal(padded[1, :, :5], weight[16:21].T) and not padded[1, :, 5:].any()


@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 4, 5, 6, 7, 16, 130])
@pytest.mark.parametrize("rows,columns", [(16, 8), (5, 64), (53, 96), (960, 576), (32, 1536)])
def test_the_kernel_equals_the_torch_reference_for_fp32_and_int8_weights(tokens, rows, columns):
    generator = torch.Generator().manual_seed(rows * 1000 + tokens)
    weight = torch.randn(rows, columns, generator=generator)
    bias = torch.randn(rows, generator=generator)
    x = torch.randn(tokens, columns, generator=generator)
    int8 = Int8Weight.quantize(weight, bias)
    for stored, scale in ((weight, torch.ones(rows)), (int8.quantized, int8.scale)):
        panels = pack_panels(stored).numpy()
        for b in (bias, None):
            expected = reference(stored, scale, x, b)
            got = panel_linear(panels, scale.numpy(), x, NO_BIAS if b is None else b.numpy())
            assert got.shape == (tokens, rows)
            # only the order of the fp32 sums differs: a few ulps of the largest partial sums
            magnitude = x.abs() @ (stored.float() * scale[:, None]).abs().T
            tolerance = 1e-5 * float(magnitude.max()) if tokens else 0.0
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)


def test_the_blocks_multiply_a_broadcast_input_fused_where_the_cpu_can():
    """Compiled afresh (a kernel loaded from numba's cache has no assembly) for the instruction
    set numba targets: on x86 with FMA (AVX2, AVX-512) each step is fused multiply-adds of a
    broadcast input (vbroadcastss, or AVX-512's broadcast operand {1to16}); on the x86-64
    baseline, packed multiplies and adds. Elsewhere only the results are checked (above)."""
    import platform

    import numba
    from llvmlite import binding

    from pdserve.kernels import cpu_panel_linear

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instructions")
    fresh = numba.njit(parallel=True)(cpu_panel_linear.panel_kernel.py_func)
    panels = pack_panels(torch.ones(16, 64)).numpy()
    out = np.empty((6, 16), np.float32)
    fresh(panels, np.ones(16, np.float32), np.ones((6, 64), np.float32), NO_BIAS, out, 1)
    assembly = "".join(fresh.inspect_asm().values())
    if numba.config.CPU_NAME == "generic":
        fused = False
    elif numba.config.CPU_FEATURES is not None:
        fused = "+fma" in numba.config.CPU_FEATURES.split(",")
    else:
        fused = bool(binding.get_host_cpu_features().get("fma", False))
    if fused:
        assert "vfmadd" in assembly
        assert "vbroadcastss" in assembly or "{1to16}" in assembly
    else:
        assert "mulps" in assembly and "addps" in assembly
