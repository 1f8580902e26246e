"""One token through every decoder layer of a Llama-family model in bf16 on the CPU, as one
compiled call: the batch-1 decode step without Python between its ops.

Why. A batch-1 step reads every weight once, so its floor is the weights' bytes over the read
bandwidth (SmolLM2-135M: 269 MB, ~9 ms on the 2-core Xeon). The one-token linears alone
(kernels/cpu_gemv.py) take ~11 ms, but the step through torch took ~24 ms: 30 layers of about
40 small torch ops each (norms, rope, the KV store, residual adds, conversions) and their
Python, at 5-20 us apiece. Here those ops are loops over a few hundred numbers inside one numba
function, which calls the same one-token linear kernel and the same decode attention kernel as
the torch path (each a parallel region over torch's threads).

What it computes, per layer, on bf16 words (uint16) with fp32 arithmetic, rounding to bf16
after each op as torch's bf16 ops (and transformers' modules) round:
  normed = rms_norm(hidden)             x * rsqrt(mean(x^2) + eps) -> bf16, times the weight -> bf16
  q, k, v = qkv_proj(normed)            the one-token kernel (with its bias, if any)
  q, k = rope(q), rope(k)               x * cos -> bf16, roll(x) * signed sin -> bf16, sum -> bf16
  cache[slot] = k, v                    the token's slot of its last block
  attention = decode_attention(q)       q * scale in fp32, the paged kernel, -> bf16
  hidden = hidden + o_proj(attention)   -> bf16
  normed = rms_norm(hidden)
  gate, up = gate_up_proj(normed)
  hidden = hidden + down_proj(silu(gate) -> bf16, times up -> bf16)
cos and signed sin are the rope tables' rows at the token's position, rounded to bf16 as the
torch path rounds them. The results differ from the torch path's only where a sum runs in
another order (the norm's mean of squares) or an exp differs in its last bit (silu): a bf16 ulp
in rare elements, the bound tests/engine/test_bf16_cpu.py states for one-token steps already.

The model's embedding, final norm and LM head stay in torch (engine/runner/one_token_step.py).
Compiled on first use for each (query heads per attention call, head dim, tokens per chunk)
and cached on disk like the other numba kernels.
"""

from __future__ import annotations

import functools

import numpy as np

try:
    import numba

    from pdserve.kernels.activation_ops import add_into, rms_norm, rope
    from pdserve.kernels.bf16_ops import from_bf16, silu_times_up, to_bf16
    from pdserve.kernels.cpu_decode_attention import decode_kernel
    from pdserve.kernels.cpu_gemv import gemv_kernel
    from pdserve.kernels.numba_compile import compiled
except ImportError:  # engine/runner/one_token_step.py reports the step unavailable
    numba = None

if numba is not None:

    def _decode_layers(
        hidden, input_norms, post_norms, eps, qkv_weights, qkv_biases, o_weights, o_biases,
        gate_up_weights, gate_up_biases, down_weights, down_biases, key_caches, value_caches,
        cos, signed_sin, block_table, seq_len, window, scale, order,
        num_heads, num_kv_heads, head_dim, heads_per_call, tokens_per_chunk,
    ):
        """hidden [hidden_size] uint16: the token's embedding in, the last layer's output out.
        Per layer l: input_norms[l] / post_norms[l] [hidden_size] uint16; the typed lists hold
        the layer's one-token weights ([out, in] uint16) and biases (uint16, empty for none);
        key_caches[l] / value_caches[l] [blocks, kv_heads, block_size, head_dim] uint16.
        cos / signed_sin [head_dim] uint16 (bf16 rows at the position); block_table [1, n]
        int32, seq_len [1] int32 (the token is at seq_len - 1, its slot already allocated);
        window 0 for none; order the attention's lane order. The last five are constants of the
        compiled code (numba.literally)."""
        numba.literally(num_heads)
        numba.literally(num_kv_heads)
        numba.literally(head_dim)
        numba.literally(heads_per_call)
        numba.literally(tokens_per_chunk)
        hidden_size = hidden.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        block_size = key_caches[0].shape[2]
        position = seq_len[0] - 1
        block, slot = block_table[0, position // block_size], position % block_size
        normed = np.empty(hidden_size, np.uint16)
        projected = np.empty(hidden_size, np.uint16)
        query = np.empty((1, num_heads, head_dim), np.float32)
        attended = np.empty((1, num_heads, head_dim), np.float32)
        attention = np.empty(q_size, np.uint16)
        for layer in range(len(qkv_weights)):
            rms_norm(hidden, input_norms[layer], eps, normed)
            qkv = np.empty(q_size + 2 * kv_size, np.uint16)
            gemv_kernel(qkv_weights[layer], normed, qkv_biases[layer], qkv)
            rope(qkv, 0, num_heads + num_kv_heads, head_dim, cos, signed_sin)
            keys, values = key_caches[layer], value_caches[layer]
            for kv_head in range(num_kv_heads):
                for d in range(head_dim):
                    keys[block, kv_head, slot, d] = qkv[q_size + kv_head * head_dim + d]
                    values[block, kv_head, slot, d] = qkv[q_size + kv_size + kv_head * head_dim + d]
            for head in range(num_heads):
                for d in range(head_dim):
                    query[0, head, d] = from_bf16(qkv[head * head_dim + d]) * scale
            decode_kernel(
                query, keys, values, block_table, seq_len, window, np.float32(1.0),
                np.float32(1.0), order, attended, heads_per_call, head_dim, tokens_per_chunk,
            )
            for head in range(num_heads):
                for d in range(head_dim):
                    attention[head * head_dim + d] = to_bf16(attended[0, head, d])
            gemv_kernel(o_weights[layer], attention, o_biases[layer], projected)
            add_into(hidden, projected)
            rms_norm(hidden, post_norms[layer], eps, normed)
            gate_up = np.empty(gate_up_weights[layer].shape[0], np.uint16)
            gemv_kernel(gate_up_weights[layer], normed, gate_up_biases[layer], gate_up)
            intermediate = gate_up.shape[0] // 2
            activated = np.empty(intermediate, np.uint16)
            silu_times_up(gate_up, intermediate, activated)
            gemv_kernel(down_weights[layer], activated, down_biases[layer], projected)
            add_into(hidden, projected)

    decode_layers_kernel = compiled(_decode_layers)

    @functools.cache
    def compiled_for(
        num_heads: int, num_kv_heads: int, head_dim: int, heads_per_call: int,
        tokens_per_chunk: int,
    ):
        """`decode_layers_kernel` for these constants, callable from Python at a jitted call's
        cost (a literal argument passed from Python is typed twice on every call)."""

        def decode(
            hidden, input_norms, post_norms, eps, qkv_weights, qkv_biases, o_weights, o_biases,
            gate_up_weights, gate_up_biases, down_weights, down_biases, key_caches,
            value_caches, cos, signed_sin, block_table, seq_len, window, scale, order,
        ):
            decode_layers_kernel(
                hidden, input_norms, post_norms, eps, qkv_weights, qkv_biases, o_weights,
                o_biases, gate_up_weights, gate_up_biases, down_weights, down_biases,
                key_caches, value_caches, cos, signed_sin, block_table, seq_len, window, scale,
                order, num_heads, num_kv_heads, head_dim, heads_per_call, tokens_per_chunk,
            )

        return compiled(decode)
