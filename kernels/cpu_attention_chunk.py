"""Up to 16 cached tokens of one sequence's decode attention, as LLVM vector code: the inner step
of kernels/cpu_decode_attention.py, emitted by numba's `intrinsic` so that every value the step
keeps lives in 16-lane fp32 registers rather than in numba arrays.

A call takes `heads` query heads that share one KV head, the rows of `tokens` keys and values
(tokens a divisor of 16; rows from the cache in place: fp32, or bf16 as their 16-bit words) and
the heads' online-softmax state (running max, running denominator, fp32 accumulators), and
folds the tokens into that state:
1. scores. For each token its key row is loaded once for all the heads (a bf16 row as 32-bit
   words: the even words shifted up 16 bits and the odd words masked are two fp32 vectors, two
   instructions for 32 values); each head multiplies it lane by lane with its query, leaving 16
   partial sums per token. Those are summed across lanes by a transposing tree (two shuffles
   and an add per pair of vectors, 45 instructions for 16 tokens, merged as the tokens come so
   that few vectors are live) whose result is one vector of the 16 tokens' scores.
2. softmax. Lanes outside [lo, hi) (the sequence's end, a sliding window's start, or past a
   short chunk) become -inf; the chunk's max updates the running max; e^(score - max) for all 16
   lanes at once (a degree-7 polynomial on the remainder after taking out powers of 2, exact to
   about 1 ulp, 0 below -87) and the correction e^(old max - new max) rescale the denominator
   and the accumulators.
3. values. Each token's value row (loaded as the keys are) is added to every head's accumulator
   times the token's weight (a broadcast from memory and dim / 16 fused multiply-adds per head).
A bf16 row's vectors hold its dims in the order `lane_order` gives (even dims of each 32, then
odd ones), so the caller lays the query out in that order and reads the accumulators back
through it; the dot products and sums do not care about the order of the dims.

Masked lanes never reach a sum: their scores are replaced, not added to, and their value rows
are replaced by zeros, so whatever lies in the unwritten part of a block (even a NaN) is
harmless.

Measured on SmolLM2-135M's shapes on the 2-core Xeon (AVX-512), per layer call: 1.8-2.2x
(fp32) and 1.5-3.3x (bf16) faster than the same loops written as numba array code, which kept
one horizontal sum per token and called the scalar exp per score (bench/results/
cpu_decode_attention.md has the grid). LLVM splits the 16-lane vectors in two on a CPU with
AVX2 only.
"""

from __future__ import annotations

import math

import numpy as np

LANES = 16


def lane_order(head_dim: int, words: bool) -> np.ndarray:
    """order[p] = the dim that lane position p of a row's vectors holds: the identity for fp32
    rows; for bf16 words, per 32 dims the 16 even then the 16 odd ones (a trailing 16 in order).
    """
    order: list[int] = []
    pairs = head_dim // 32 if words else 0
    for c in range(pairs):
        order += [32 * c + 2 * i for i in range(LANES)]
        order += [32 * c + 2 * i + 1 for i in range(LANES)]
    order += range(32 * pairs, head_dim)
    return np.array(order, np.int64)


try:
    from llvmlite import ir
    from numba import errors, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # cpu_decode_attention.py reports the kernel unavailable
    ir = None

if ir is not None:
    F32 = ir.FloatType()
    I32 = ir.IntType(32)
    I64 = ir.IntType(64)
    FLOATS = ir.VectorType(F32, LANES)
    INTS = ir.VectorType(I32, LANES)
    EXP_FLOOR = -87.0  # e^-87 is near fp32's smallest normal; below it the weight is 0
    LN2_HIGH, LN2_LOW = 0.693145751953125, 1.428606765330187e-06  # ln 2 = high + low

    class _Vectors:
        """The vector operations the step is built from, emitted with one IR builder."""

        def __init__(self, builder: ir.IRBuilder) -> None:
            self.builder = builder
            self._fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(FLOATS, [FLOATS] * 3), "llvm.fma.v16f32"
            )
            self._rint = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(FLOATS, [FLOATS]), "llvm.rint.v16f32"
            )
            self._sum = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(F32, [F32, FLOATS]),
                "llvm.vector.reduce.fadd.v16f32",
            )

        @staticmethod
        def constant(value: float) -> ir.Constant:
            return ir.Constant(FLOATS, [float(value)] * LANES)

        def splat(self, scalar: ir.Value, vector_type: ir.VectorType = FLOATS) -> ir.Value:
            first = self.builder.insert_element(
                ir.Constant(vector_type, None), scalar, ir.Constant(I32, 0)
            )
            return self.builder.shuffle_vector(
                first, ir.Constant(vector_type, None), ir.Constant(INTS, [0] * LANES)
            )

        def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
            return self.builder.call(self._fma, [a, b, c])

        def larger(self, a: ir.Value, b: ir.Value) -> ir.Value:
            """a > b ? a : b (the CPU's max; LLVM's maxnum would add NaN handling)."""
            return self.builder.select(self.builder.fcmp_ordered(">", a, b), a, b)

        def exp(self, x: ir.Value) -> ir.Value:
            """e^x lane by lane for x <= 0; 0 below EXP_FLOOR (-inf included)."""
            b = self.builder
            above_floor = b.fcmp_ordered(">", x, self.constant(EXP_FLOOR))
            x = b.select(above_floor, x, self.constant(EXP_FLOOR))
            n = b.call(self._rint, [b.fmul(x, self.constant(1.0 / math.log(2.0)))])
            remainder = self.fma(n, self.constant(-LN2_HIGH), x)
            remainder = self.fma(n, self.constant(-LN2_LOW), remainder)
            power = self.constant(1.0 / math.factorial(7))
            for k in range(6, -1, -1):
                power = self.fma(power, remainder, self.constant(1.0 / math.factorial(k)))
            two_to_n = b.shl(
                b.add(b.fptosi(n, INTS), ir.Constant(INTS, [127] * LANES)),
                ir.Constant(INTS, [23] * LANES),
            )
            return b.select(
                above_floor, b.fmul(power, b.bitcast(two_to_n, FLOATS)), self.constant(0.0)
            )

        def lane_max(self, x: ir.Value) -> ir.Value:
            width = LANES
            while width > 1:
                width //= 2
                upper = [width + i % width for i in range(LANES)]
                x = self.larger(
                    x,
                    self.builder.shuffle_vector(
                        x, ir.Constant(FLOATS, None), ir.Constant(INTS, upper)
                    ),
                )
            return self.builder.extract_element(x, ir.Constant(I32, 0))

        def lane_sum(self, x: ir.Value) -> ir.Value:
            return self.builder.call(
                self._sum, [ir.Constant(F32, 0.0), x], fastmath=("reassoc",)
            )

        def merge_sums(self, first: ir.Value, second: ir.Value, width: int) -> ir.Value:
            """Two vectors holding tokens' partial sums `width` lanes per token (first's tokens
            before second's) -> one vector holding all of them, width / 2 lanes per token."""
            tokens, half = LANES // width, width // 2
            lower, upper = [], []
            for source in (0, 1):
                for token in range(tokens):
                    start = source * LANES + token * width
                    lower += range(start, start + half)
                    upper += range(start + half, start + width)
            b = self.builder
            return b.fadd(
                b.shuffle_vector(first, second, ir.Constant(INTS, lower)),
                b.shuffle_vector(first, second, ir.Constant(INTS, upper)),
            )

    def _load_row(builder: ir.IRBuilder, data: ir.Value, start: int, head_dim: int, words: bool):
        """The row of `head_dim` values at element `start` of `data`, as head_dim / 16 fp32
        vectors in `lane_order`."""
        b = builder

        def vector_at(offset: int, vector_type: ir.VectorType, align: int) -> ir.Value:
            pointer = b.gep(data, [ir.Constant(I64, start + offset)])
            return b.load(b.bitcast(pointer, vector_type.as_pointer()), align=align)

        if not words:
            return [vector_at(16 * c, FLOATS, 4) for c in range(head_dim // LANES)]
        shift, high_half = ir.Constant(INTS, [16] * LANES), ir.Constant(INTS, [-65536] * LANES)
        vectors = []
        pairs = head_dim // 32
        for c in range(pairs):
            both = vector_at(32 * c, INTS, 2)
            vectors.append(b.bitcast(b.shl(both, shift), FLOATS))
            vectors.append(b.bitcast(b.and_(both, high_half), FLOATS))
        for c in range((head_dim - 32 * pairs) // LANES):
            single = vector_at(32 * pairs + 16 * c, ir.VectorType(ir.IntType(16), LANES), 2)
            vectors.append(b.bitcast(b.shl(b.zext(single, INTS), shift), FLOATS))
        return vectors

    @intrinsic
    def attention_chunk(
        typingctx, query, keys, values, acc, maxes, sums, lo, hi, heads, head_dim, tokens, masked
    ):
        """attention_chunk(query, keys, values, acc, maxes, sums, lo, hi, heads, head_dim,
        tokens, masked): query and acc [heads * head_dim] fp32 in `lane_order` (query scaled);
        keys and values [tokens, head_dim] contiguous rows, fp32 or uint16 (bf16 words); maxes
        and sums [heads] fp32; lo, hi the chunk's first and past-last valid token (only read
        when `masked`; unmasked, every token is valid). heads, head_dim (a multiple of 16),
        tokens (a divisor of 16) and masked are compile-time constants (a jitted caller's
        closure variables), so each combination is its own straight-line code."""
        shapes = (heads, head_dim, tokens, masked)
        if not all(isinstance(t, types.Literal) for t in shapes):
            raise errors.RequireLiteralValue("heads, head_dim, tokens and masked")
        signature = types.void(query, keys, values, acc, maxes, sums, lo, hi, *shapes)
        heads, head_dim, tokens, masked = (t.literal_value for t in shapes)
        vectors_per_row = head_dim // LANES
        words = keys.dtype == types.uint16

        def codegen(context, builder, sig, args):
            b = builder
            v = _Vectors(b)
            query_data, key_data, value_data, acc_data, max_data, sum_data = (
                context.make_array(array_type)(context, b, value).data
                for array_type, value in zip(sig.args[:6], args[:6])
            )
            first, end = args[6], args[7]

            def vector_pointer(data: ir.Value, offset: int) -> ir.Value:
                pointer = b.gep(data, [ir.Constant(I64, offset)])
                return b.bitcast(pointer, FLOATS.as_pointer())

            def head_vectors(data: ir.Value, head: int) -> list[ir.Value]:
                return [
                    b.load(vector_pointer(data, head * head_dim + 16 * c), align=4)
                    for c in range(vectors_per_row)
                ]

            query_vectors = [head_vectors(query_data, h) for h in range(heads)]
            lane_index = ir.Constant(INTS, list(range(LANES)))
            valid_lanes = None
            if masked:
                valid_lanes = b.and_(
                    b.icmp_signed(">=", lane_index, v.splat(b.trunc(first, I32), INTS)),
                    b.icmp_signed("<", lane_index, v.splat(b.trunc(end, I32), INTS)),
                )
            elif tokens < LANES:
                valid_lanes = b.icmp_signed("<", lane_index, ir.Constant(INTS, [tokens] * LANES))

            # 1. scores: partial sums per token, merged pairwise as they come.
            pending: list[list[tuple[int, ir.Value]]] = [[] for _ in range(heads)]
            for token in range(LANES):
                row = (
                    _load_row(b, key_data, token * head_dim, head_dim, words)
                    if token < tokens
                    else None
                )
                for h in range(heads):
                    if row is None:
                        partial = v.constant(0.0)
                    else:
                        partial = b.fmul(query_vectors[h][0], row[0])
                        for c in range(1, vectors_per_row):
                            partial = v.fma(query_vectors[h][c], row[c], partial)
                    stack = pending[h]
                    stack.append((LANES, partial))
                    while len(stack) > 1 and stack[-1][0] == stack[-2][0]:
                        (width, second), (_, earlier) = stack.pop(), stack.pop()
                        stack.append((width // 2, v.merge_sums(earlier, second, width)))

            # 2. softmax: weights of the chunk's tokens, state rescaled to the new max.
            weights = cgutils.alloca_once(b, FLOATS, size=heads)
            corrections = []
            for h in range(heads):
                scores = pending[h][0][1]
                if valid_lanes is not None:
                    scores = b.select(valid_lanes, scores, v.constant(-math.inf))
                max_pointer = b.gep(max_data, [ir.Constant(I64, h)])
                sum_pointer = b.gep(sum_data, [ir.Constant(I64, h)])
                old_max = b.load(max_pointer)
                new_max = v.larger(v.lane_max(scores), old_max)
                weight = v.exp(b.fsub(scores, v.splat(new_max)))
                correction = b.extract_element(
                    v.exp(v.splat(b.fsub(old_max, new_max))), ir.Constant(I32, 0)
                )
                b.store(
                    b.fadd(b.fmul(b.load(sum_pointer), correction), v.lane_sum(weight)),
                    sum_pointer,
                )
                b.store(new_max, max_pointer)
                b.store(weight, b.gep(weights, [ir.Constant(I32, h)]))
                corrections.append(v.splat(correction))

            # 3. values, weighted into the rescaled accumulators.
            accumulators = [
                [b.fmul(vector, corrections[h]) for vector in head_vectors(acc_data, h)]
                for h in range(heads)
            ]
            weight_floats = b.bitcast(weights, F32.as_pointer())
            for token in range(tokens):
                row = _load_row(b, value_data, token * head_dim, head_dim, words)
                if masked:
                    index = ir.Constant(first.type, token)
                    valid = b.and_(
                        b.icmp_signed(">=", index, first), b.icmp_signed("<", index, end)
                    )
                    row = [b.select(valid, vector, v.constant(0.0)) for vector in row]
                for h in range(heads):
                    weight_pointer = b.gep(weight_floats, [ir.Constant(I64, h * LANES + token)])
                    weight = v.splat(b.load(weight_pointer))
                    for c in range(vectors_per_row):
                        accumulators[h][c] = v.fma(weight, row[c], accumulators[h][c])
            for h in range(heads):
                for c in range(vectors_per_row):
                    pointer = vector_pointer(acc_data, h * head_dim + 16 * c)
                    b.store(accumulators[h][c], pointer, align=4)
            return context.get_dummy_value()

        return signature, codegen
