"""One token through a bf16 linear layer on the CPU: y = W x + b, read at the memory's speed,
with the AVX512-BF16 dot-product instruction (vdpbf16ps), compiled by numba.

Why. A batch-1 decode step streams every weight once, so its linears are bound by how fast the
weights are read. oneDNN's prepacked bf16 matmul, which the engine uses for every batch, reads
them at ~18 GB/s on the 2-core Xeon with AMX-BF16 where the read bandwidth is ~30 GB/s. This
kernel reads the default model's 121 matrices (one round, weights from memory) at 78% of it:
11.7 ms a round against oneDNN's 15.0 (1.29x), side by side in `python -m pdserve.bench.gemv_b1`
(bench/results/gemv_b1.md; 1.47x in a side run). Widening bf16 to fp32 and multiplying in
fp32, as an earlier numba kernel did, reads at 48%: the dot-product instruction takes 32 words
of each operand and their products at once, with no widening.

How. The weight stays in HF's row-major [out, in] layout (bf16 words; `in` a multiple of 32).
Four rows at a time, each keeps 16 fp32 lanes; every step loads 32 words of each row and of x
and adds their pairwise products into the lanes (vdpbf16ps: exact products, fp32 sums rounded to
nearest even; bf16 subnormals count as zero), while the rows four ahead are prefetched. The
lanes are summed, the bias (bf16) added in fp32 and the result rounded to bf16 (nearest even), as
oneDNN does, up to the order of the sums (so the outputs can differ from oneDNN's by a bf16 ulp).
The blocks of rows are split over numba's threads, as many as torch uses.

numba emits the instruction through LLVM's intrinsic, so the kernel exists only where LLVM
compiles for a CPU with AVX512-BF16 (`cpu_gemv_available`): Intel Cooper Lake and Sapphire
Rapids on, AMD Zen 4 on. Elsewhere the engine keeps oneDNN (or `F.linear`). Compiled on first
use and cached on disk like the decode attention kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels.numba_threads import run_parallel

try:
    import numba
    from llvmlite import binding as llvm_binding
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from pdserve.kernels.bf16_ops import from_bf16, to_bf16
    from pdserve.kernels.llvm_prefetch import emit_prefetch
    from pdserve.kernels.numba_compile import compiled
except ImportError:  # the engine keeps oneDNN
    numba = None

ROWS_PER_BLOCK = 4
WORDS_PER_STEP = 32  # bf16 words one vdpbf16ps takes from a row


def cpu_gemv_available() -> bool:
    """Whether numba compiles for a CPU with AVX512-BF16 here (the host CPU, unless numba was
    told to compile for another: NUMBA_CPU_NAME)."""
    if numba is None or numba.config.CPU_NAME not in (None, "host"):
        return False
    return bool(llvm_binding.get_host_cpu_features().get("avx512bf16", False))


def gemv_fits(weight: torch.Tensor) -> bool:
    """Whether the kernel can multiply by this weight ([out, in] bf16 on the CPU, in a multiple
    of 32)."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % WORDS_PER_STEP == 0
    )


if numba is not None:

    class _BFloat(ir.Type):
        """LLVM's bfloat, which llvmlite's IR builder does not name: only the intrinsic's
        operand type, never a constant."""

        def _to_string(self) -> str:
            return "bfloat"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, _BFloat)

        def __hash__(self) -> int:
            return hash("bfloat")

    def _dot_rows(rows: int):
        """An intrinsic: (weight, first_row, x) -> the dot products of weight rows first_row
        .. first_row + rows - 1 with x, as a tuple of fp32 (see the module's docstring)."""

        @intrinsic
        def dot(typingctx, weight, first_row, x):
            signature = types.UniTuple(types.float32, rows)(weight, first_row, x)

            def codegen(context, builder, sig, args):
                weights = context.make_array(sig.args[0])(context, builder, args[0])
                vector = context.make_array(sig.args[2])(context, builder, args[2])
                i64 = ir.IntType(64)
                lanes = ir.VectorType(ir.FloatType(), 16)
                words = ir.VectorType(ir.IntType(16), WORDS_PER_STEP)
                pairs = ir.VectorType(_BFloat(), WORDS_PER_STEP)
                module = builder.module
                dot_product = cgutils.get_or_insert_function(
                    module, ir.FunctionType(lanes, [lanes, pairs, pairs]),
                    "llvm.x86.avx512bf16.dpbf16ps.512",
                )
                lane_sum = cgutils.get_or_insert_function(
                    module, ir.FunctionType(ir.FloatType(), [ir.FloatType(), lanes]),
                    "llvm.vector.reduce.fadd.v16f32",
                )
                in_features = builder.extract_value(weights.shape, 1)
                ahead = builder.mul(ir.Constant(i64, rows), in_features)
                starts = [
                    builder.mul(builder.add(args[1], ir.Constant(i64, r)), in_features)
                    for r in range(rows)
                ]
                sums = [
                    cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * 16))
                    for _ in range(rows)
                ]

                def load_words(data_pointer, index):
                    address = builder.bitcast(
                        builder.gep(data_pointer, [index]), words.as_pointer()
                    )
                    return builder.bitcast(builder.load(address, align=2), pairs)

                step = ir.Constant(i64, WORDS_PER_STEP)
                with cgutils.for_range_slice(
                    builder, ir.Constant(i64, 0), in_features, step, intp=i64
                ) as (i, _):
                    x_pairs = load_words(vector.data, i)
                    for r in range(rows):
                        index = builder.add(starts[r], i)
                        emit_prefetch(
                            builder, builder.gep(weights.data, [builder.add(index, ahead)])
                        )
                        total = builder.call(
                            dot_product,
                            [builder.load(sums[r]), load_words(weights.data, index), x_pairs],
                        )
                        builder.store(total, sums[r])
                results = [
                    builder.call(
                        lane_sum, [ir.Constant(ir.FloatType(), 0.0), builder.load(s)],
                        fastmath=("reassoc",),
                    )
                    for s in sums
                ]
                return context.make_tuple(builder, sig.return_type, results)

            return signature, codegen

        return dot

    _dot_block = _dot_rows(ROWS_PER_BLOCK)
    _dot_row = _dot_rows(1)

    @njit(inline="always")
    def _bias(bias, row):
        """bias[row] (a bf16 word) as fp32; 0 for no bias (an empty array)."""
        if bias.shape[0] == 0:
            return np.float32(0.0)
        return from_bf16(bias[row])

    def _gemv_loops(weight, x, bias, out):
        """weight [out, in] uint16 (bf16 words), x [in] uint16, bias [out] uint16 (empty for
        none), out [out] uint16: out = bf16(weight @ x + bias)."""
        num_rows = weight.shape[0]
        num_blocks = num_rows // ROWS_PER_BLOCK
        for block in prange(num_blocks):
            first = block * ROWS_PER_BLOCK
            sums = _dot_block(weight, first, x)
            for r in range(ROWS_PER_BLOCK):
                out[first + r] = to_bf16(sums[r] + _bias(bias, first + r))
        for row in range(num_blocks * ROWS_PER_BLOCK, num_rows):
            out[row] = to_bf16(_dot_row(weight, row, x)[0] + _bias(bias, row))

    gemv_kernel = compiled(_gemv_loops, parallel=True)


def bf16_words(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous bf16 tensor as the uint16 words the kernel reads (shared, no copy)."""
    return tensor.view(torch.int16).numpy().view(np.uint16)


def gemv_bf16(x: torch.Tensor, weight: np.ndarray, bias: np.ndarray) -> torch.Tensor:
    """[1, in] bf16 x -> [1, out] bf16, with `weight` and `bias` from `bf16_words` of a weight
    that `gemv_fits` and of its bf16 bias (an empty array for none). Unchecked: the engine's Linear
    checks once, when it keeps the weight (engine/layers/linear.py)."""
    out = torch.empty(1, weight.shape[0], dtype=torch.bfloat16)
    run_parallel(gemv_kernel, weight, bf16_words(x.contiguous())[0], bias, bf16_words(out)[0])
    return out
