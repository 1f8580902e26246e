"""The one-token bf16 linear kernel (kernels/cpu_gemv.py) on a CPU with AVX512-BF16: its
output is the fp32 product rounded to bf16, within one bf16 ulp (its sums run in another order
than an fp32 reference's), rounded as torch rounds, on shapes whose rows are not a multiple of
its block of four; the engine's Linear takes it for one token only, and keeps oneDNN where the
kernel cannot run (those tests run on every CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers.linear import Linear, OneTokenWeight
from pdserve.kernels import cpu_gemv
from pdserve.kernels.cpu_gemv import bf16_words, cpu_gemv_available, gemv_bf16, gemv_fits

needs_avx512_bf16 = pytest.mark.skipif(
    not cpu_gemv_available(), reason="numba does not compile for AVX512-BF16 on this CPU"
)


def bf16_ulp(reference: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each value (2^(exponent - 7))."""
    exponent = torch.frexp(reference.abs().clamp_min(2.0**-120))[1]
    return torch.pow(2.0, (exponent - 8).float())


@needs_avx512_bf16
@pytest.mark.parametrize("rows, columns", [(960, 576), (7, 32), (4, 1536), (1, 64), (4098, 576)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_kernel_equals_the_fp32_product_rounded_to_bf16(rows, columns, with_bias):
    generator = torch.Generator().manual_seed(rows + columns)
    weight = (torch.randn(rows, columns, generator=generator) * 0.05).bfloat16()
    x = torch.randn(1, columns, generator=generator).bfloat16()
    bias = torch.randn(rows, generator=generator).bfloat16() if with_bias else torch.zeros(0)

    out = gemv_bf16(x, bf16_words(weight), bf16_words(bias.bfloat16()))

    reference = x.float() @ weight.float().T + (bias.float() if with_bias else 0.0)
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows)
    assert ((out.float() - reference).abs() <= bf16_ulp(reference)).all()


@needs_avx512_bf16
def test_kernel_rounds_to_nearest_even_as_torch_does_and_keeps_nan():
    """Weight row r picks x[r] (one 1.0 in the row), so output r is x[r] + bias[r] computed
    exactly in fp32: pairs of bf16 numbers whose sums are ties, a subnormal, an overflow,
    infinities and a NaN."""
    pairs = [
        (1.0, 2**-8), (1.0, 3 * 2**-8), (-1.0, -(2**-8)), (2**-126, -(2**-127)),
        (1.0, float("inf")), (1.0, float("-inf")), (3.3895e38, 3.3895e38), (1.0, float("nan")),
        (0.0, 0.0), (0.5, 1.0),
    ]
    rows = len(pairs)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :rows] = torch.tensor([a for a, _ in pairs]).bfloat16()
    bias = torch.tensor([b for _, b in pairs]).bfloat16()
    weight = torch.zeros(rows, 32, dtype=torch.bfloat16)
    weight[torch.arange(rows), torch.arange(rows)] = 1.0

    out = gemv_bf16(x, bf16_words(weight), bf16_words(bias))

    expected = (x.float()[0, :rows] + bias.float()).to(torch.bfloat16)
    nan = torch.isnan(expected)
    assert nan.sum() == 1 and torch.equal(torch.isnan(out[0]), nan)
    assert torch.equal(out[0][~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert out[0, 0] == 1.0 and out[0, 1] == 1 + 2**-6 and out[0, 6] == float("inf")


def test_only_bf16_cpu_weights_whose_rows_hold_whole_steps_of_32_fit():
    assert gemv_fits(torch.zeros(3, 64, dtype=torch.bfloat16))
    assert not gemv_fits(torch.zeros(3, 48, dtype=torch.bfloat16))
    assert not gemv_fits(torch.zeros(3, 64))
    assert not gemv_fits(torch.zeros(64, dtype=torch.bfloat16))


def test_the_kernel_is_unavailable_when_numba_compiles_for_another_cpu(monkeypatch):
    if cpu_gemv.numba is None:
        assert not cpu_gemv_available()
        return
    monkeypatch.setattr(cpu_gemv.numba.config, "CPU_NAME", "generic")
    assert not cpu_gemv_available()


def packed_bf16_linear() -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A packed 576 -> 960 bf16 layer with a bias, and copies of its weight and bias."""
    torch.manual_seed(960)
    layer = Linear(576, 960, bias=True, dtype=torch.bfloat16)
    layer.load("weight", torch.randn(960, 576, dtype=torch.bfloat16) * 0.05)
    layer.load("bias", torch.randn(960, dtype=torch.bfloat16))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    return layer, weight, bias


@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_a_linear_takes_the_kernel_for_one_token_only(tokens, monkeypatch):
    layer, weight, bias = packed_bf16_linear()
    assert (layer.one_token is not None) == (
        cpu_gemv_available() and layer.packed_weight is not None
    )
    calls = []
    if layer.one_token is not None:
        kernel = layer.one_token._gemv
        monkeypatch.setattr(layer.one_token, "_gemv", lambda *a: calls.append(1) or kernel(*a))
    x = torch.randn(tokens, 576, dtype=torch.bfloat16)

    out = layer(x)

    assert len(calls) == (1 if tokens == 1 and layer.one_token is not None else 0)
    torch.testing.assert_close(out, F.linear(x, weight, bias))


def test_a_linear_keeps_onednn_where_the_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "cpu_gemv_available", lambda: False)
    layer, weight, bias = packed_bf16_linear()
    assert layer.one_token is None
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))


def test_no_one_token_copy_of_an_fp32_weight_or_of_rows_the_kernel_cannot_step_through():
    assert OneTokenWeight.for_weight(torch.zeros(8, 64), None) is None
    assert OneTokenWeight.for_weight(torch.zeros(8, 48, dtype=torch.bfloat16), None) is None


def test_a_bf16_model_keeps_a_row_major_copy_of_each_linear_only_where_the_kernel_runs(
    tiny_llama_dir,
):
    from pdserve.engine import LLM

    model = LLM(str(tiny_llama_dir), dtype="bfloat16").engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    expected = sum(m.in_features * m.out_features * 2 for m in linears)
    assert model.one_token_copy_bytes() == (expected if cpu_gemv_available() else 0)
    assert all((m.one_token is not None) == cpu_gemv_available() for m in linears)
    if cpu_gemv_available():  # one buffer (on huge pages), each copy 64-byte aligned in it
        copies = sorted((m.one_token for m in linears), key=lambda c: c.weight.data_ptr())
        assert len({c.weight.untyped_storage().data_ptr() for c in copies}) == 1
        for copy, after in itertools.pairwise(copies):
            assert copy.weight.data_ptr() % 64 == 0
            assert copy.weight.data_ptr() + copy.num_bytes <= after.weight.data_ptr()
