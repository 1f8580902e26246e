"""A linear layer whose weight is stored in 4 bits (`--quantization int4`: one scale and one
minimum per output row and group of GROUP inputs), for any number of tokens on any CPU,
compiled by numba for the host's vectors (AVX2, AVX-512, NEON alike), its products summed in
integers.

Why. A batch-1 decode step reads every weight once, so its linears are bound by the weights'
bytes where the multiplying keeps up: 4-bit values with an fp16 scale and minimum per 32 take 5
bits a weight, 0.63x of int8's 8.25 (its fp32 scale per row included) and 0.16x of fp32's 32.
llama.cpp's Q4_1 stores the same values, so a model shipped in it (the default model's GGUF)
is multiplied with exactly its file's weights. Multiplied in fp32 (each 4-bit value widened,
converted and fused-multiply-added), the default model's weights went through at 23 G weights/s
on two threads of a Xeon held to AVX2, as fast as int8's, so no faster a step; summed as
integers, 32 products take two instructions (below).

What it computes, for x [tokens, in] fp32 (`reference` below, in torch):
    w[o, i]  = q[o, i] * scale[o, g] + minimum[o, g]          q in 0 .. 15, g = i // GROUP
    x8[t, i] = round(x[t, i] / s[t, g])                      s[t, g] = max_i |x[t, i]| / 127
    y[t, o]  = sum_g(scale[o, g] * s[t, g] * sum_i(q[o, i] * x8[t, i])
                     + minimum[o, g] * sum_i(x[t, i])) + bias[o]
The inputs are rounded to int8 per token and group (as llama.cpp's Q8_1 does for its Q4_1
dots); the minimum's term takes the exact sum of the inputs. The integer sums are exact; the
rest is fp32, its order the kernel's.

How. The weight is packed in panels of PANEL_ROWS output rows (as kernels/cpu_panel_linear.py
packs fp32 and int8 ones), in groups: a panel's group is CHUNKS chunks of 32 bytes, one per four
inputs i..i+3, whose byte 4m + j holds row m's input i + j in its low nibble and row m + 8's in
its high one; then the 16 rows' fp16 scales and their 16 fp16 minimums (widened by F16C on x86,
in integers where the target has no such instruction): GROUP_BYTES = 320 contiguous bytes, five
cache lines. For each chunk a block of up to TOKENS_PER_BLOCK tokens splits the 32 bytes into
their low and high nibbles (an `and`, a shift) and multiplies each by a token's four int8
inputs i..i+3, broadcast as one 32-bit word, summing adjacent products: x86's vpmaddubsw with
AVX2 (4-bit values are unsigned, inputs signed, as it wants), written out in LLVM IR elsewhere.
16-bit lanes 2m and 2m + 1 then hold row m's two pairs (of rows 0-7 from the low nibbles, 8-15
from the high ones), and stay 16-bit for a group (at most 8 x 2 x 15 x 127 = 30,480); at a
group's end each lane pair is added into one 32-bit row sum (vpmaddwd by ones), and each row's
fp32 running sum takes it times scale * s, plus minimum * the inputs' sum. One broadcast a
token and chunk (an earlier layout, pairs of rows' inputs i, i + 1 | i + 2, i + 3 in
a byte's nibbles, took two) made the kernel 1.2-1.4x as fast at 8 to 512 tokens (the default
model's linears on a Xeon held to AVX2; no change at 1 to 4 tokens, where memory bounds it).
The panels are split over numba's threads in contiguous runs; while a panel's blocks multiply,
they ask for the next panel's lines into the second-level cache (llvm.prefetch), a share of
each group's five lines per block.

Rows that fill no whole panel are padded with zero scales and minimums, inputs that fill no
whole group with zero values (and zero inputs). Compiled on first use and cached on disk like
the other numba kernels (numba's cache is kept per CPU name and features, and so is the choice
between vpmaddubsw and the written-out form).
"""

from __future__ import annotations

import platform

import numpy as np
import torch
import torch.nn.functional as F

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from pdserve.kernels.llvm_prefetch import CACHE_LINE_BYTES, emit_prefetch
    from pdserve.kernels.numba_compile import compiled
    from pdserve.kernels.numba_threads import run_parallel
except ImportError:  # engine/layers/int4_weight.py dequantizes instead
    numba = None

GROUP = 32  # inputs that share one scale and one minimum per output row
PANEL_ROWS = 16  # output rows per panel: one vector of sums per token
HALF_ROWS = PANEL_ROWS // 2  # rows in a chunk's low nibbles, and in its high ones
QMAX = 15  # 4-bit values are 0 .. 15
INPUT_QMAX = 127  # inputs are rounded to -127 .. 127 per token and group
CHUNKS = GROUP // 4  # a group's 32-byte chunks, four inputs of 16 rows each
QUANT_BYTES = GROUP * PANEL_ROWS // 2  # a group's 4-bit values in a panel
GROUP_BYTES = QUANT_BYTES + 2 * PANEL_ROWS * 2  # and its fp16 scales and minimums
TOKENS_PER_BLOCK = 4  # tokens that share each chunk's split nibbles
TOKENS_PER_PASS = 60  # tokens that go through all of a thread's panels before the next ones


def _target_has_avx2() -> bool:
    """Whether numba compiles for x86 with AVX2 (its NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else
    the host's)."""
    if numba is None or platform.machine() not in ("x86_64", "AMD64"):
        return False
    from llvmlite import binding

    if numba.config.CPU_NAME == "generic":
        return False
    if numba.config.CPU_FEATURES is not None:
        return "+avx2" in numba.config.CPU_FEATURES.split(",")
    return bool(binding.get_host_cpu_features().get("avx2", False))


_TARGET_HAS_AVX2 = _target_has_avx2()

# fp16 widened to fp32, as LLVM IR: one instruction on a target that has it (x86's F16C, ARM);
# elsewhere LLVM calls a library function numba's JIT may not hold (the baseline x86-64 crashes).
_WIDEN_HALVES_IR = """
define <8 x float> @widen(<8 x half> %halves) {
  %widened = fpext <8 x half> %halves to <8 x float>
  ret <8 x float> %widened
}
"""
_HALF_LIBRARY_CALLS = ("extendhfsf2", "h2f_ieee")  # LLVM's names for that function


def _target_widens_halves() -> bool:
    """Whether numba's target (its NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else the host) widens
    fp16 to fp32 in its own instructions: LLVM is asked to compile `_WIDEN_HALVES_IR` for it."""
    if numba is None:
        return False
    from llvmlite import binding
    from numba.core.codegen import get_host_cpu_features, initialize_llvm

    initialize_llvm()  # what numba does before it compiles: its target registered
    features = numba.config.CPU_FEATURES
    machine = binding.Target.from_triple(binding.get_process_triple()).create_target_machine(
        cpu=numba.config.CPU_NAME or binding.get_host_cpu_name(),
        features=get_host_cpu_features() if features is None else features,
    )
    assembly = machine.emit_assembly(binding.parse_assembly(_WIDEN_HALVES_IR))
    return not any(call in assembly for call in _HALF_LIBRARY_CALLS)


_TARGET_WIDENS_HALVES = _target_widens_halves()


def _fp16(values: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to fp16 and back (what the kernel reads)."""
    return values.to(torch.float16).float()


def _grouped(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, in] fp32 -> ([rows, groups, GROUP] zero-padded, [groups, GROUP] bool: real inputs)."""
    rows, in_features = values.shape
    groups = -(-in_features // GROUP)
    padded = F.pad(values, (0, groups * GROUP - in_features))
    real = torch.arange(groups * GROUP).view(groups, GROUP) < in_features
    return padded.view(rows, groups, GROUP), real


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] of any float dtype -> (q [out, in] uint8 in 0 .. 15, scale and minimum
    [out, ceil(in / GROUP)] fp32 holding fp16 values): per row and group, minimum = the smallest
    weight and scale = (largest - smallest) / 15, both rounded to fp16 first, then
    q = round((w - minimum) / scale) clamped to 0 .. 15 (a group of equal weights: scale 0, q 0).
    A weight that is not finite, or whose group's minimum or scale fp16 cannot hold (beyond
    65,504), raises ValueError. Weights that llama.cpp's Q4_1 stood for (a GGUF's) come back as
    its exact 4-bit values, scales and minimums."""
    grouped, real = _grouped(weight.detach().float())
    smallest = torch.where(real, grouped, torch.inf).amin(dim=2)
    largest = torch.where(real, grouped, -torch.inf).amax(dim=2)
    minimum = _fp16(smallest)
    scale = _fp16((largest - smallest) / QMAX)
    if not (torch.isfinite(minimum).all() and torch.isfinite(scale).all()):
        raise ValueError(
            "int4 quantization needs finite weights whose groups' minimums and ranges / 15 fp16 "
            f"holds (at most 65,504 in size); this weight's lie in [{weight.min()}, {weight.max()}]"
        )
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((grouped - minimum[:, :, None]) / divisor[:, :, None]).clamp_(0, QMAX)
    q = q.flatten(1)[:, : weight.shape[1]].to(torch.uint8)
    return q.contiguous(), scale.contiguous(), minimum.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that (q, scale, minimum) from `quantize` stand for."""
    in_features = q.shape[1]
    per_input = lambda values: values.repeat_interleave(GROUP, dim=1)[:, :in_features]
    return q.float() * per_input(scale) + per_input(minimum)


def quantize_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> (x8 [tokens, in] int8, s [tokens, groups] fp32, the inputs' exact sums
    [tokens, groups] fp32), as the module's docstring gives them."""
    grouped, _ = _grouped(x.float())
    scale = grouped.abs().amax(dim=2) / INPUT_QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    x8 = torch.round(grouped / divisor[:, :, None]).flatten(1)[:, : x.shape[1]]
    return x8.to(torch.int8), scale, grouped.sum(dim=2)


def reference(
    q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """What the kernel computes, in torch (the integer sums exact in fp64)."""
    x8, input_scale, input_sum = quantize_inputs(x)
    weights, _ = _grouped(q.double())  # [out, groups, GROUP]
    inputs, _ = _grouped(x8.double())  # [tokens, groups, GROUP]
    dots = torch.einsum("ogi,tgi->tog", weights, inputs).float()  # [tokens, out, groups]
    y = (dots * scale[None] * input_scale[:, None, :]).sum(dim=2)
    y = y + (minimum[None] * input_sum[:, None, :]).sum(dim=2)
    return y if bias is None else y + bias.float()


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """(q, scale, minimum) from `quantize` -> panels [ceil(out / 16), groups, GROUP_BYTES]
    uint8 (the module's docstring tells the layout; little-endian fp16)."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    rows = -(-out_features // PANEL_ROWS) * PANEL_ROWS
    q = F.pad(q, (0, groups * GROUP - in_features, 0, rows - out_features))
    # panel, (row m | m + 8), group, chunk, input j -> panel, group, chunk, m, j
    halves = q.view(-1, 2, HALF_ROWS, groups, CHUNKS, 4)
    nibbles = halves[:, 0] | (halves[:, 1] << 4)  # [panels, m, groups, chunks, j]
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(-1, groups, QUANT_BYTES)

    def fp16_bytes(values: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [panels, groups, 32]
        padded = F.pad(values, (0, 0, 0, rows - out_features)).to(torch.float16)
        by_panel = padded.view(-1, PANEL_ROWS, groups).transpose(1, 2).contiguous()
        return by_panel.view(torch.uint8)

    return torch.cat([nibbles, fp16_bytes(scale), fp16_bytes(minimum)], dim=2).contiguous()


if numba is not None:

    def _pairs_multiplied_unsigned_by_signed(builder, low, inputs):
        """<32 x i8> unsigned 4-bit values times <32 x i8> signed inputs, each adjacent pair's
        two products summed: <16 x i16>. x86 with AVX2 has it as one instruction (vpmaddubsw,
        whose saturation these magnitudes never reach); elsewhere it is written out."""
        i16x16 = ir.VectorType(ir.IntType(16), PANEL_ROWS)
        if _TARGET_HAS_AVX2:
            bytes32 = ir.VectorType(ir.IntType(8), 2 * PANEL_ROWS)
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i16x16, [bytes32, bytes32]),
                "llvm.x86.avx2.pmadd.ub.sw",
            )
            return builder.call(function, [low, inputs])
        i16x32 = ir.VectorType(ir.IntType(16), 2 * PANEL_ROWS)
        products = builder.mul(builder.zext(low, i16x32), builder.sext(inputs, i16x32))
        i32 = ir.IntType(32)
        even = ir.Constant(ir.VectorType(i32, PANEL_ROWS), list(range(0, 2 * PANEL_ROWS, 2)))
        odd = ir.Constant(ir.VectorType(i32, PANEL_ROWS), list(range(1, 2 * PANEL_ROWS, 2)))
        return builder.add(
            builder.shuffle_vector(products, products, even),
            builder.shuffle_vector(products, products, odd),
        )

    def _widened_halves(builder, pointer):
        """The PANEL_ROWS fp16 values at byte `pointer` as <16 x float>: one instruction where
        the target has one (`_target_widens_halves`); elsewhere in integers, exact for every
        finite value (`quantize` stores no other): the magnitude's bits moved into fp32's
        places, times 2^112 (the exponents' bias apart; an fp16 subnormal becomes an fp32 one),
        and the sign put back."""
        lanes = ir.VectorType(ir.FloatType(), PANEL_ROWS)
        if _TARGET_WIDENS_HALVES:
            halves = ir.VectorType(ir.HalfType(), PANEL_ROWS)
            address = builder.bitcast(pointer, halves.as_pointer())
            return builder.fpext(builder.load(address, align=2), lanes)
        i16x16 = ir.VectorType(ir.IntType(16), PANEL_ROWS)
        i32x16 = ir.VectorType(ir.IntType(32), PANEL_ROWS)
        splat = lambda value: ir.Constant(i32x16, [value] * PANEL_ROWS)
        address = builder.bitcast(pointer, i16x16.as_pointer())
        words = builder.zext(builder.load(address, align=2), i32x16)
        magnitude = builder.shl(builder.and_(words, splat(0x7FFF)), splat(13))
        rebiased = builder.fmul(
            builder.bitcast(magnitude, lanes), ir.Constant(lanes, [2.0**112] * PANEL_ROWS)
        )
        sign = builder.shl(builder.and_(words, splat(0x8000)), splat(16))
        return builder.bitcast(builder.or_(builder.bitcast(rebiased, i32x16), sign), lanes)

    def _rows_of_pairs(builder, low_rows, high_rows):
        """Two <16 x i16> whose lanes 2m and 2m + 1 belong to row m (of rows 0-7, and of rows
        8-15) -> <16 x i32>, lane j row j's sum."""
        i32 = ir.IntType(32)
        wide = ir.VectorType(i32, PANEL_ROWS)
        even = ir.Constant(ir.VectorType(i32, HALF_ROWS), list(range(0, PANEL_ROWS, 2)))
        odd = ir.Constant(ir.VectorType(i32, HALF_ROWS), list(range(1, PANEL_ROWS, 2)))
        halves = []
        for pairs in (low_rows, high_rows):
            widened = builder.sext(pairs, wide)
            halves.append(
                builder.add(
                    builder.shuffle_vector(widened, widened, even),
                    builder.shuffle_vector(widened, widened, odd),
                )
            )
        return builder.shuffle_vector(
            *halves, ir.Constant(ir.VectorType(i32, PANEL_ROWS), list(range(PANEL_ROWS)))
        )

    def _block(tokens: int):
        """An intrinsic: (panels, panel, x8, input_scales, group_sums, first_token, out, block,
        blocks) stores into out[first_token + t, panel * 16 + j] row j's dot product with the
        token's input, for t < tokens (see the module's docstring). As block `block` of `blocks`
        of this panel it asks for its share of the next panel's lines."""

        @intrinsic
        def block(
            typingctx, panels, panel, x8, input_scales, group_sums, first_token, out, block,
            blocks,
        ):
            signature = types.void(
                panels, panel, x8, input_scales, group_sums, first_token, out, block, blocks
            )

            def codegen(context, builder, sig, args):
                panel_index, first, block_index, num_blocks = args[1], args[5], args[7], args[8]
                data, quantized_inputs, scales_of_inputs, sums_of_groups, outputs = (
                    context.make_array(sig.args[i])(context, builder, args[i])
                    for i in (0, 2, 3, 4, 6)
                )
                data = data.data
                i64, i32, i16, i8 = (ir.IntType(bits) for bits in (64, 32, 16, 8))
                const = lambda value: ir.Constant(i64, value)
                lanes = ir.VectorType(ir.FloatType(), PANEL_ROWS)
                i16x16 = ir.VectorType(i16, PANEL_ROWS)
                i32x8 = ir.VectorType(i32, HALF_ROWS)
                bytes32 = ir.VectorType(i8, 2 * PANEL_ROWS)
                fmuladd = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(lanes, [lanes, lanes, lanes]),
                    f"llvm.fmuladd.v{PANEL_ROWS}f32",
                )

                def broadcast(value, vector_type):
                    one = builder.insert_element(
                        ir.Constant(vector_type, None), value, ir.Constant(i32, 0)
                    )
                    count = vector_type.count
                    zeros = ir.Constant(ir.VectorType(i32, count), [0] * count)
                    return builder.shuffle_vector(one, ir.Constant(vector_type, None), zeros)

                def fp16_vector(byte_offset):
                    return _widened_halves(builder, builder.gep(data, [byte_offset]))

                def element(array, row, column):  # array[row, column] of a 2-D C array
                    width = builder.extract_value(array.shape, 1)
                    index = builder.add(builder.mul(row, width), column)
                    return builder.gep(array.data, [index])

                groups = builder.extract_value(sums_of_groups.shape, 1)
                panel_bytes = builder.mul(groups, const(GROUP_BYTES))
                panel_start = builder.mul(panel_index, panel_bytes)
                next_panel = builder.add(panel_start, panel_bytes)
                lines = const(GROUP_BYTES // CACHE_LINE_BYTES)
                rows = [builder.add(first, const(t)) for t in range(tokens)]
                running = [
                    cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * PANEL_ROWS))
                    for _ in range(tokens)
                ]
                low_mask = ir.Constant(bytes32, [0x0F] * 2 * PANEL_ROWS)
                four = ir.Constant(bytes32, [4] * 2 * PANEL_ROWS)
                with cgutils.for_range(builder, groups, intp=i64) as group_loop:
                    group = group_loop.index
                    group_start = builder.add(panel_start, builder.mul(group, const(GROUP_BYTES)))
                    # this block's share of the next panel: lines [share(n), share(n + 1))
                    turn = builder.add(builder.mul(block_index, groups), group)
                    share = lambda n: builder.sdiv(builder.mul(n, lines), num_blocks)
                    with cgutils.for_range_slice(
                        builder, share(turn), share(builder.add(turn, const(1))), const(1),
                        intp=i64,
                    ) as (line, _):
                        offset = builder.mul(line, const(CACHE_LINE_BYTES))
                        emit_prefetch(
                            builder, builder.gep(data, [builder.add(next_panel, offset)]),
                            locality=2,
                        )
                    first_input = builder.mul(group, const(GROUP))
                    # per token, rows 0-7 (low nibbles) and rows 8-15 (high ones): lanes 2m and
                    # 2m + 1 hold row m's two pairs; at most 8 x 3,810 in an i16 lane
                    sums = [[ir.Constant(i16x16, [0] * PANEL_ROWS)] * 2 for _ in range(tokens)]
                    for chunk in range(CHUNKS):
                        address = builder.bitcast(
                            builder.gep(data, [builder.add(group_start, const(chunk * 32))]),
                            bytes32.as_pointer(),
                        )
                        packed = builder.load(address, align=1)
                        low = builder.and_(packed, low_mask)
                        high = builder.and_(builder.lshr(packed, four), low_mask)
                        column = builder.add(first_input, const(4 * chunk))
                        for t in range(tokens):
                            pointer = builder.bitcast(
                                element(quantized_inputs, rows[t], column), i32.as_pointer()
                            )
                            fours = builder.bitcast(
                                broadcast(builder.load(pointer, align=1), i32x8), bytes32
                            )
                            sums[t] = [
                                builder.add(
                                    part,
                                    _pairs_multiplied_unsigned_by_signed(builder, nibbles, fours),
                                )
                                for part, nibbles in zip(sums[t], (low, high))
                            ]
                    totals = [_rows_of_pairs(builder, *parts) for parts in sums]
                    scale = fp16_vector(builder.add(group_start, const(QUANT_BYTES)))
                    minimum = fp16_vector(
                        builder.add(group_start, const(QUANT_BYTES + 2 * PANEL_ROWS))
                    )
                    for t in range(tokens):
                        input_scale = builder.load(element(scales_of_inputs, rows[t], group))
                        group_sum = builder.load(element(sums_of_groups, rows[t], group))
                        weighted = builder.fmul(scale, broadcast(input_scale, lanes))
                        total = builder.call(
                            fmuladd,
                            [builder.sitofp(totals[t], lanes), weighted, builder.load(running[t])],
                        )
                        total = builder.call(fmuladd, [minimum, broadcast(group_sum, lanes), total])
                        builder.store(total, running[t])
                first_column = builder.mul(panel_index, const(PANEL_ROWS))
                for t in range(tokens):
                    address = builder.bitcast(
                        element(outputs, rows[t], first_column), lanes.as_pointer()
                    )
                    builder.store(builder.load(running[t]), address, align=4)
                return context.get_dummy_value()

            return signature, codegen

        return block

    _block1, _block2, _block3, _block4 = (
        _block(tokens) for tokens in range(1, TOKENS_PER_BLOCK + 1)
    )

    @njit(inline="always")
    def _tokens_of_panel(panels, panel, x8, input_scales, group_sums, out, first, last):
        """Tokens first .. last - 1 through one panel, a block at a time."""
        blocks = (last - first + TOKENS_PER_BLOCK - 1) // TOKENS_PER_BLOCK
        for block in range(blocks):
            token = first + block * TOKENS_PER_BLOCK
            rest = last - token
            if rest >= 4:
                _block4(panels, panel, x8, input_scales, group_sums, token, out, block, blocks)
            elif rest == 3:
                _block3(panels, panel, x8, input_scales, group_sums, token, out, block, blocks)
            elif rest == 2:
                _block2(panels, panel, x8, input_scales, group_sums, token, out, block, blocks)
            else:
                _block1(panels, panel, x8, input_scales, group_sums, token, out, block, blocks)

    @njit(inline="always")
    def _quantize_inputs(x, groups):
        """x [tokens, in] fp32 -> (x8 [tokens, groups * GROUP] int8, zero-padded; its scales
        and the exact sums of x, both [tokens, groups] fp32): per token and group,
        scale = max |x| / 127 and x8 = round(x / scale) (a group of zeros: scale 0, x8 0)."""
        tokens, depth = x.shape
        x8 = np.zeros((tokens, groups * GROUP), np.int8)
        input_scales = np.zeros((tokens, groups), np.float32)
        group_sums = np.zeros((tokens, groups), np.float32)
        for t in range(tokens):
            for group in range(groups):
                end = min(depth, (group + 1) * GROUP)
                largest = np.float32(0.0)
                total = np.float32(0.0)
                for i in range(group * GROUP, end):
                    largest = max(largest, abs(x[t, i]))
                    total += x[t, i]
                group_sums[t, group] = total
                if largest > 0:
                    scale = largest / np.float32(INPUT_QMAX)
                    input_scales[t, group] = scale
                    for i in range(group * GROUP, end):
                        x8[t, i] = np.int8(np.round(x[t, i] / scale))
        return x8, input_scales, group_sums

    def _int4_loops(panels, x, bias, out, num_chunks):
        """num_chunks: one per thread, each a contiguous run of panels. The panels' sums go
        into `out` directly when its rows are whole panels, else into a scratch array."""
        num_panels, groups = panels.shape[0], panels.shape[1]
        tokens = x.shape[0]
        x8, input_scales, group_sums = _quantize_inputs(x, groups)
        whole = out.shape[1] == num_panels * PANEL_ROWS
        sums = out if whole else np.empty((tokens, num_panels * PANEL_ROWS), np.float32)
        per_chunk = (num_panels + num_chunks - 1) // num_chunks
        for chunk in prange(num_chunks):
            panels_end = min(num_panels, (chunk + 1) * per_chunk)
            for first in range(0, tokens, TOKENS_PER_PASS):
                for panel in range(chunk * per_chunk, panels_end):
                    _tokens_of_panel(
                        panels, panel, x8, input_scales, group_sums, sums, first,
                        min(tokens, first + TOKENS_PER_PASS),
                    )
            if whole and bias.shape[0] == 0:
                continue  # the sums are the outputs
            for panel in range(chunk * per_chunk, panels_end):
                last = min(out.shape[1], (panel + 1) * PANEL_ROWS)  # padding rows: left
                for t in range(tokens):
                    for o in range(panel * PANEL_ROWS, last):
                        value = sums[t, o]
                        if bias.shape[0] != 0:
                            value += bias[o]
                        out[t, o] = value

    int4_kernel = compiled(_int4_loops, parallel=True)


def int4_linear(
    panels: np.ndarray, x: torch.Tensor, bias: np.ndarray, out_features: int
) -> torch.Tensor:
    """x [tokens, in] fp32 -> [tokens, out_features] fp32, `panels` from `pack` as a numpy view,
    `bias` [out] fp32 (empty for none). Unchecked: engine/layers/int4_weight.py checks once,
    when it quantizes the weight."""
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    run_parallel(int4_kernel, panels, x.numpy(), bias, out.numpy(), torch.get_num_threads())
    return out


def int4_kernel_available() -> bool:
    return numba is not None
