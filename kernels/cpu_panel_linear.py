"""A linear layer for two tokens and more (decode batches, prefill chunks) on any CPU: the
weight packed in panels of 16 output rows stored input-major, multiplied by a register-blocked
loop of pdserve's own, compiled by numba for the host's vectors (AVX2, AVX-512, NEON alike).

Why. A decode step of 16 sequences multiplies 16 tokens by every weight. On the default model's
120 decoder matrices at 16 tokens (2-core Intel Xeon held to AVX2), oneDNN's prepacked fp32
matmul (the engine's batch path before) took 47-50 ms and the row-major many-token loop of
kernels/cpu_int8_linear.py (since removed) 49-50 ms, where reading the 425 MB of fp32 weights
takes ~18 ms at the machine's 23 GB/s and their multiply-adds ~27 ms at the rate this kernel
reaches on int8 weights (128 GFLOP/s): bound by neither, each waited for memory and then
multiplied, the two not overlapping.

How. For each output panel, a block of up to TOKENS_PER_BLOCK tokens keeps one vector of
PANEL_ROWS running sums per token in registers (six tokens: twelve 8-lane AVX2 registers, six
AVX-512 ones). Each step over the input loads the panel's 16 weights of that input once (one
contiguous 64-byte line in fp32, 16 bytes in int8, widened to fp32 in registers) and adds their
products with each token's input, broadcast, into that token's sums (LLVM's fmuladd: one fused
multiply-add where the CPU has them). No lanes are reduced: each lane is one output. The
panel (16 x in: 36 KiB at in=576) stays in the core's caches while the next blocks of tokens
reuse it, so the weight is read from memory once per pass; the panels are split over numba's
threads in contiguous runs, and TOKENS_PER_PASS tokens go through all of a thread's panels
before the next ones (their inputs stay in the core's second-level cache).
While its blocks multiply, a panel asks for the next panel's lines into the second-level cache
(llvm.prefetch), spread evenly over all of its blocks' steps, so reading overlaps multiplying.
At 16 tokens, same machine: 51 ms without asking, 38 ms asking in the first block only (its
steps then wait on the requests), 28.6 ms spread over the blocks.

What it computes, for x [tokens, in] fp32:
    y[t, o] = scale[o] * sum_i(weight[o, i] * x[t, i]) + bias[o]
as kernels/cpu_int8_linear.py's `reference`, up to the order of the fp32 sums (here: in input
order, fused). An fp32 weight is given with every scale 1.

A weight whose rows are not a multiple of PANEL_ROWS gets a last panel padded with zeros
(whose outputs are computed and dropped). Compiled on first use and cached on disk like the
other numba kernels. Side by side with oneDNN: `python -m pdserve.bench.linear_batches`.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from pdserve.kernels.llvm_prefetch import emit_prefetch
    from pdserve.kernels.numba_compile import compiled
    from pdserve.kernels.numba_threads import run_parallel
except ImportError:  # the layer keeps its other kernels
    numba = None

PANEL_ROWS = 16  # outputs per panel: one vector of sums per token (two AVX2 registers)
TOKENS_PER_BLOCK = 6  # 6 tokens x 2 AVX2 registers of sums + 2 of weights + 1 broadcast = 15 of 16
TOKENS_PER_PASS = 60  # tokens that go through all of a thread's panels before the next ones
AHEAD_SHIFT = 16  # fixed point of the next panel's element a step asks for


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / PANEL_ROWS), in, PANEL_ROWS], contiguous: panel p, input i
    holds weight[p * PANEL_ROWS : (p + 1) * PANEL_ROWS, i], the last panel padded with rows of
    zeros."""
    out_features, in_features = weight.shape
    padding = -out_features % PANEL_ROWS
    if padding:
        weight = torch.cat([weight, weight.new_zeros(padding, in_features)])
    panels = weight.reshape(-1, PANEL_ROWS, in_features)
    return panels.transpose(1, 2).contiguous()


if numba is not None:

    def _block(tokens: int):
        """An intrinsic: (panels, panel, x, first_token, out, ahead_start, ahead_step) stores
        into out[first_token + t, panel * PANEL_ROWS + j] the dot product of x[first_token + t]
        with the panel's row j, for t < tokens (see the module's docstring). At input i it
        asks for the next panel's element (ahead_start + i * ahead_step) >> AHEAD_SHIFT."""

        @intrinsic
        def block(typingctx, panels, panel, x, first_token, out, ahead_start, ahead_step):
            signature = types.void(
                panels, panel, x, first_token, out, ahead_start, ahead_step
            )

            def codegen(context, builder, sig, args):
                weights = context.make_array(sig.args[0])(context, builder, args[0])
                inputs = context.make_array(sig.args[2])(context, builder, args[2])
                outputs = context.make_array(sig.args[4])(context, builder, args[4])
                i64 = ir.IntType(64)
                lanes = ir.VectorType(ir.FloatType(), PANEL_ROWS)
                fmuladd = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(lanes, [lanes, lanes, lanes]),
                    f"llvm.fmuladd.v{PANEL_ROWS}f32",
                )
                widen = sig.args[0].dtype != types.float32
                stored = ir.VectorType(weights.data.type.pointee, PANEL_ROWS)
                depth = builder.extract_value(weights.shape, 1)
                rows = ir.Constant(i64, PANEL_ROWS)
                panel_start = builder.mul(builder.mul(args[1], depth), rows)
                x_rows = [
                    builder.mul(builder.add(args[3], ir.Constant(i64, t)), depth)
                    for t in range(tokens)
                ]
                sums = [
                    cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * PANEL_ROWS))
                    for _ in range(tokens)
                ]
                all_zero = ir.Constant(ir.VectorType(ir.IntType(32), PANEL_ROWS), [0] * PANEL_ROWS)
                next_panel = builder.add(panel_start, builder.mul(depth, rows))
                with cgutils.for_range(builder, depth, intp=i64) as loop:
                    start = builder.add(panel_start, builder.mul(loop.index, rows))
                    ahead = builder.add(args[5], builder.mul(loop.index, args[6]))
                    offset = builder.ashr(ahead, ir.Constant(i64, AHEAD_SHIFT))
                    emit_prefetch(
                        builder, builder.gep(weights.data, [builder.add(next_panel, offset)]),
                        locality=2,
                    )
                    address = builder.bitcast(
                        builder.gep(weights.data, [start]), stored.as_pointer()
                    )
                    column = builder.load(address, align=1 if widen else 4)
                    if widen:
                        column = builder.sitofp(
                            builder.sext(column, ir.VectorType(ir.IntType(32), PANEL_ROWS)),
                            lanes,
                        )
                    for t in range(tokens):
                        value = builder.load(
                            builder.gep(inputs.data, [builder.add(x_rows[t], loop.index)])
                        )
                        one = builder.insert_element(
                            ir.Constant(lanes, None), value, ir.Constant(ir.IntType(32), 0)
                        )
                        broadcast = builder.shuffle_vector(one, ir.Constant(lanes, None), all_zero)
                        total = builder.call(fmuladd, [column, broadcast, builder.load(sums[t])])
                        builder.store(total, sums[t])
                out_columns = builder.extract_value(outputs.shape, 1)
                first_column = builder.mul(args[1], rows)
                for t in range(tokens):
                    row = builder.add(args[3], ir.Constant(i64, t))
                    index = builder.add(builder.mul(row, out_columns), first_column)
                    address = builder.bitcast(
                        builder.gep(outputs.data, [index]), lanes.as_pointer()
                    )
                    builder.store(builder.load(sums[t]), address, align=4)
                return context.get_dummy_value()

            return signature, codegen

        return block

    _block1, _block2, _block3, _block4, _block5, _block6 = (
        _block(tokens) for tokens in range(1, TOKENS_PER_BLOCK + 1)
    )

    @njit(inline="always")
    def _tokens_of_panel(panels, panel, x, out, first, last):
        """Tokens first .. last - 1 through one panel, a block at a time. Together the blocks
        ask for the whole next panel, spread evenly over their steps: block b of n asks at its
        input i for element (b * in + i) * PANEL_ROWS / n of the next panel (in fixed point)."""
        blocks = (last - first + TOKENS_PER_BLOCK - 1) // TOKENS_PER_BLOCK
        step = (PANEL_ROWS << AHEAD_SHIFT) // blocks
        depth = panels.shape[1]
        for block in range(blocks):
            token = first + block * TOKENS_PER_BLOCK
            start = block * depth * step
            rest = last - token
            if rest >= 6:
                _block6(panels, panel, x, token, out, start, step)
            elif rest == 5:
                _block5(panels, panel, x, token, out, start, step)
            elif rest == 4:
                _block4(panels, panel, x, token, out, start, step)
            elif rest == 3:
                _block3(panels, panel, x, token, out, start, step)
            elif rest == 2:
                _block2(panels, panel, x, token, out, start, step)
            else:
                _block1(panels, panel, x, token, out, start, step)

    def _panel_loops(panels, scale, x, bias, out, num_chunks):
        """num_chunks: one per thread, each a contiguous run of panels."""
        num_panels = panels.shape[0]
        per_chunk = (num_panels + num_chunks - 1) // num_chunks
        tokens = x.shape[0]
        for chunk in prange(num_chunks):
            panels_end = min(num_panels, (chunk + 1) * per_chunk)
            for first in range(0, tokens, TOKENS_PER_PASS):
                for panel in range(chunk * per_chunk, panels_end):
                    _tokens_of_panel(
                        panels, panel, x, out, first, min(tokens, first + TOKENS_PER_PASS)
                    )
            for panel in range(chunk * per_chunk, panels_end):
                last = min(scale.shape[0], (panel + 1) * PANEL_ROWS)  # padding rows: left
                for t in range(x.shape[0]):
                    for o in range(panel * PANEL_ROWS, last):
                        value = out[t, o] * scale[o]
                        if bias.shape[0] != 0:
                            value += bias[o]
                        out[t, o] = value

    panel_kernel = compiled(_panel_loops, parallel=True)


def panel_linear(
    panels: np.ndarray, scale: np.ndarray, x: torch.Tensor, bias: np.ndarray
) -> torch.Tensor:
    """x [tokens, in] fp32 -> [tokens, out] fp32, `panels` from `pack_panels` (fp32 or int8) as
    a numpy view, `scale` [out] fp32, `bias` [out] fp32 (empty for none). Unchecked: the layer
    checks once, when it packs the weight."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], panels.shape[0] * PANEL_ROWS, dtype=torch.float32)
    run_parallel(panel_kernel, panels, scale, x.numpy(), bias, out.numpy(), torch.get_num_threads())
    out_features = scale.shape[0]
    return out if out_features == out.shape[1] else out[:, :out_features].contiguous()


def panel_kernel_available() -> bool:
    return numba is not None
