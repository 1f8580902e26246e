"""One token through every decoder layer of a Llama-family model with fp32 activations and
int8 (`--quantization int8`), 4-bit (`--quantization int4`) or fp32 weights on the CPU, as one
compiled call: the batch-1 decode step without Python between its ops, on any CPU numba
compiles for (AVX2, AVX-512, NEON).

Why. With int8 weights a batch-1 step of SmolLM2-135M reads 134 MB, ~5 ms at the read bandwidth
of a 2-core server, and its linears (kernels/cpu_int8_linear.py) take about that; through torch
the step took ~19 ms on a 2-core AMD EPYC, most of it the ~40 small torch ops per layer and
their Python; compiled, it takes 6.5 ms. Here those ops are loops over a few hundred numbers
inside one numba function (the norm, rope and residual adds of kernels/activation_ops.py, which
the batch glue runs too), which calls the same linear kernel and the same paged decode
attention kernel (kernels/cpu_decode_attention.py) as the torch path. fp32 weights go through
the same linear kernel with every row's scale 1 (numba compiles the function once per weight
type), so an fp32 model's step is exact but for the order of its sums. 4-bit weights go
through kernels/cpu_int4_linear.py's kernel (`_linear` picks it by the weight's shape: its
panels are 3-D).

What it computes, per layer, in fp32 (the torch forward's ops, engine/models/llama.py):
  normed = rms_norm(hidden)             x * rsqrt(mean(x^2) + eps) * weight
  q, k, v = qkv_proj(normed)            the linear kernel (per-row scales, bias if any)
  q, k = rope(q), rope(k)               x * cos + roll(x, half) * signed_sin
  cache[slot] = k, v                    the token's slot of its last block
  attention = decode_attention(q)       q * scale, the paged kernel
  hidden = hidden + o_proj(attention)
  normed = rms_norm(hidden)
  gate, up = gate_up_proj(normed)
  hidden = hidden + down_proj(silu(gate) * up)
The results differ from the torch path's only in the order of fp32 sums (the norm's mean of
squares, the linears) and in exp's last bit (silu): ~1e-6 relative, far inside int8's own error
(tests/engine/test_quantized_weights.py); with 4-bit weights an input rounded to int8 inside a
linear can land on the other side of a rounding boundary, a step of that value (INT4_TOLERANCES
in tests/engine/test_fp32_decode_step.py, which checks every weight type against the torch
forward).

The embedding, final norm and LM head stay torch modules (engine/runner/fp32_one_token_step.py).
Compiled on first use for each (query heads, KV heads, head dim, query heads per attention call,
tokens per chunk) and cached on disk like the other numba kernels.
"""

from __future__ import annotations

import functools

import numpy as np

try:
    import numba
    from numba.extending import overload

    from pdserve.kernels.activation_ops import add_into, rms_norm, rope
    from pdserve.kernels.cpu_decode_attention import decode_kernel
    from pdserve.kernels.cpu_int4_linear import int4_kernel
    from pdserve.kernels.cpu_int8_linear import one_token_kernel
    from pdserve.kernels.numba_compile import compiled
except ImportError:  # engine/runner/fp32_one_token_step.py reports the step unavailable
    numba = None

if numba is not None:

    def _linear(weight, scale, x, bias, out, threads):
        """out = x @ weight.T (per-row scales, bias if any), by the kernel of the weight's form:
        [out, in] int8 or fp32 rows (kernels/cpu_int8_linear.py), or 4-bit panels
        (kernels/cpu_int4_linear.py, 3-D; `scale` unused). Chosen when numba types the call."""

    @overload(_linear)
    def _linear_for(weight, scale, x, bias, out, threads):
        if weight.ndim == 3:
            return lambda weight, scale, x, bias, out, threads: int4_kernel(
                weight, x, bias, out, threads
            )
        return lambda weight, scale, x, bias, out, threads: one_token_kernel(
            weight, scale, x, bias, out, threads
        )

    def _decode_layers(
        hidden, input_norms, post_norms, eps, intermediate, qkv_weights, qkv_scales, qkv_biases,
        o_weights, o_scales, o_biases, gate_up_weights, gate_up_scales, gate_up_biases,
        down_weights, down_scales, down_biases, key_caches, value_caches, cos, signed_sin,
        block_table, seq_len, window, scale, order, threads, num_heads, num_kv_heads, head_dim,
        heads_per_call, tokens_per_chunk,
    ):
        """hidden [1, hidden_size] fp32: the token's embedding in, the last layer's output out.
        Per layer l: input_norms[l] / post_norms[l] [hidden_size] fp32; intermediate: the MLP's
        size; the typed lists hold the layer's weights ([out, in] int8 or fp32, or 4-bit
        panels), fp32 scales ([out]; empty for 4-bit) and fp32 biases (empty for none);
        key_caches[l] / value_caches[l] [blocks, kv_heads, block_size, head_dim] fp32.
        cos / signed_sin [head_dim] fp32 rows at the position; block_table [1, n] int32,
        seq_len [1] int32 (the token is at seq_len - 1, its slot already allocated); window 0
        for none; order the attention's lane order; threads the linears' chunks of rows (one per
        thread). The last five are constants of the compiled code (numba.literally)."""
        numba.literally(num_heads)
        numba.literally(num_kv_heads)
        numba.literally(head_dim)
        numba.literally(heads_per_call)
        numba.literally(tokens_per_chunk)
        hidden_size = hidden.shape[1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        block_size = key_caches[0].shape[2]
        position = seq_len[0] - 1
        block, slot = block_table[0, position // block_size], position % block_size
        normed = np.empty((1, hidden_size), np.float32)
        projected = np.empty((1, hidden_size), np.float32)
        qkv = np.empty((1, q_size + 2 * kv_size), np.float32)
        query = np.empty((1, num_heads, head_dim), np.float32)
        attended = np.empty((1, num_heads, head_dim), np.float32)
        gate_up = np.empty((1, 2 * intermediate), np.float32)
        activated = np.empty((1, intermediate), np.float32)
        for layer in range(len(qkv_weights)):
            rms_norm(hidden[0], input_norms[layer], eps, normed[0])
            _linear(
                qkv_weights[layer], qkv_scales[layer], normed, qkv_biases[layer], qkv, threads
            )
            rope(qkv[0], 0, num_heads + num_kv_heads, head_dim, cos, signed_sin)  # q and k
            keys, values = key_caches[layer], value_caches[layer]
            for kv_head in range(num_kv_heads):
                for d in range(head_dim):
                    keys[block, kv_head, slot, d] = qkv[0, q_size + kv_head * head_dim + d]
                    values[block, kv_head, slot, d] = qkv[
                        0, q_size + kv_size + kv_head * head_dim + d
                    ]
            for head in range(num_heads):
                for d in range(head_dim):
                    query[0, head, d] = qkv[0, head * head_dim + d] * scale
            decode_kernel(
                query, keys, values, block_table, seq_len, window, np.float32(1.0),
                np.float32(1.0), order, attended, heads_per_call, head_dim, tokens_per_chunk,
            )
            _linear(
                o_weights[layer], o_scales[layer], attended.reshape(1, q_size), o_biases[layer],
                projected, threads,
            )
            add_into(hidden[0], projected[0])
            rms_norm(hidden[0], post_norms[layer], eps, normed[0])
            _linear(
                gate_up_weights[layer], gate_up_scales[layer], normed, gate_up_biases[layer],
                gate_up, threads,
            )
            for i in range(intermediate):
                gate = gate_up[0, i]
                activated[0, i] = gate / (np.float32(1.0) + np.exp(-gate)) * gate_up[
                    0, intermediate + i
                ]
            _linear(
                down_weights[layer], down_scales[layer], activated, down_biases[layer], projected,
                threads,
            )
            add_into(hidden[0], projected[0])

    decode_layers_kernel = compiled(_decode_layers)

    @functools.cache
    def compiled_for(
        num_heads: int, num_kv_heads: int, head_dim: int, heads_per_call: int,
        tokens_per_chunk: int,
    ):
        """`decode_layers_kernel` for these constants, callable from Python at a jitted call's
        cost (a literal argument passed from Python is typed twice on every call)."""

        def decode(
            hidden, input_norms, post_norms, eps, intermediate, qkv_weights, qkv_scales,
            qkv_biases, o_weights, o_scales, o_biases, gate_up_weights, gate_up_scales,
            gate_up_biases, down_weights, down_scales, down_biases, key_caches, value_caches, cos,
            signed_sin, block_table, seq_len, window, scale, order, threads,
        ):
            decode_layers_kernel(
                hidden, input_norms, post_norms, eps, intermediate, qkv_weights, qkv_scales,
                qkv_biases, o_weights, o_scales, o_biases, gate_up_weights, gate_up_scales,
                gate_up_biases, down_weights, down_scales, down_biases, key_caches, value_caches,
                cos, signed_sin, block_table, seq_len, window, scale, order, threads, num_heads,
                num_kv_heads, head_dim, heads_per_call, tokens_per_chunk,
            )

        return compiled(decode)
