"""The small ops between the linears of a decode batch on the CPU, compiled by numba: each
stretch from one linear's output to the next linear's input is one call over every row of
the batch, in place of a dozen torch ops and their Python per layer.

Per layer of a batch of decoding sequences (one token each), on activations held as bf16 words
(uint16) or fp32, with the ops of kernels/activation_ops.py (fp32 arithmetic; on bf16 words
rounded to bf16 after each op, as kernels/cpu_decode_step.py computes one token); numba
compiles each kernel once per activation type:
  `norm_rows`              input norm of the residual stream (the first layer)
  [qkv_proj]
  `rope_store_attend`      rope on q and k, the KV store, q * scale, the paged decode attention
                           (kernels/cpu_decode_attention.py), its output in the activations' type
  [o_proj]
  `add_norm_rows`          residual add, then the post-attention norm
  [the MLP]
  `add_norm_rows`          residual add, then the next layer's input norm (or the final norm)
The linears stay the model's own (panels, or oneDNN's prepacked matmuls for bf16:
engine/layers/linear.py), called from Python, and the MLP keeps torch's SiLU between its two:
vectorized, it beat this file's scalar SiLU (libm's exp per element) by 2-4% of `make bench`'s
throughput, where compiling the rope into `rope_store_attend` gained 1-2% over torch's rope ops.
Rows are split over numba's threads (prange); the attention is the decode kernel's own
parallel loop. Results match the torch forward except where the norm's mean of squares sums
in another order (in bf16 an ulp in rare elements, cpu_decode_step.py says how rare; in fp32
~1e-7 relative).
"""

from __future__ import annotations

import functools

import numpy as np

try:
    import numba
    from numba import prange

    from pdserve.kernels.activation_ops import add_into, narrow, rms_norm, rope, widen
    from pdserve.kernels.cpu_decode_attention import decode_kernel
    from pdserve.kernels.numba_compile import compiled
except ImportError:  # engine/runner/decode_batch_step.py reports the path unavailable
    numba = None

if numba is not None:

    def _norm_rows(hidden, weight, eps, out):
        """out[r] = rms_norm(hidden[r]) for every row."""
        for row in prange(hidden.shape[0]):
            rms_norm(hidden[row], weight, eps, out[row])

    def _add_norm_rows(hidden, other, weight, eps, out):
        """hidden[r] += other[r], then out[r] = rms_norm(hidden[r])."""
        for row in prange(hidden.shape[0]):
            add_into(hidden[row], other[row])
            rms_norm(hidden[row], weight, eps, out[row])

    def _rope_store_attend(
        qkv, cos, signed_sin, keys, values, block_tables, seq_lens, window, scale, order,
        query, attended, out, num_heads, num_kv_heads, head_dim, heads_per_call, tokens,
    ):
        """qkv [rows, (num_heads + 2 * num_kv_heads) * head_dim] (rope applied in place);
        cos / signed_sin [rows, head_dim]; keys / values one layer's caches [blocks, kv_heads,
        block_size, head_dim]; out [rows, num_heads * head_dim]: all of one type, bf16 words
        (uint16) or fp32. block_tables [rows, n] int32; seq_lens [rows] int32 (row r's token
        at seq_lens[r] - 1); query / attended [rows, num_heads, head_dim] fp32 scratch."""
        numba.literally(num_heads)
        numba.literally(num_kv_heads)
        numba.literally(head_dim)
        numba.literally(heads_per_call)
        numba.literally(tokens)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        block_size = keys.shape[2]
        for row in prange(qkv.shape[0]):
            rope(qkv[row], 0, num_heads + num_kv_heads, head_dim, cos[row], signed_sin[row])
            position = seq_lens[row] - 1
            block = block_tables[row, position // block_size]
            slot = position % block_size
            for kv_head in range(num_kv_heads):
                for d in range(head_dim):
                    keys[block, kv_head, slot, d] = qkv[row, q_size + kv_head * head_dim + d]
                    values[block, kv_head, slot, d] = qkv[
                        row, q_size + kv_size + kv_head * head_dim + d
                    ]
            for head in range(num_heads):
                for d in range(head_dim):
                    query[row, head, d] = widen(qkv[row, head * head_dim + d]) * scale
        decode_kernel(
            query, keys, values, block_tables, seq_lens, window, np.float32(1.0),
            np.float32(1.0), order, attended, heads_per_call, head_dim, tokens,
        )
        for row in prange(qkv.shape[0]):
            for head in range(num_heads):
                for d in range(head_dim):
                    out[row, head * head_dim + d] = narrow(attended[row, head, d], out)

    norm_rows = compiled(_norm_rows, parallel=True)
    add_norm_rows = compiled(_add_norm_rows, parallel=True)
    _rope_store_attend_kernel = compiled(_rope_store_attend, parallel=True)

    @functools.cache
    def rope_store_attend_for(
        num_heads: int, num_kv_heads: int, head_dim: int, heads_per_call: int, tokens: int
    ):
        """`_rope_store_attend` for these constants, callable from Python at a jitted call's
        cost (a literal argument passed from Python is typed twice on every call)."""

        def rope_store_attend(
            qkv, cos, signed_sin, keys, values, block_tables, seq_lens, window, scale, order,
            query, attended, out,
        ):
            _rope_store_attend_kernel(
                qkv, cos, signed_sin, keys, values, block_tables, seq_lens, window, scale,
                order, query, attended, out, num_heads, num_kv_heads, head_dim,
                heads_per_call, tokens,
            )

        return compiled(rope_store_attend, parallel=False)
