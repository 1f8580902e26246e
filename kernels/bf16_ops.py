"""bf16 numbers as 16-bit words in numba code, and the small ops of a Llama-family decoder layer
on them, rounding as torch's bf16 ops round: each op computes in fp32 and rounds its result to
bf16 (nearest even). Shared by the compiled decode paths (cpu_decode_step.py, cpu_decode_glue.py)
and the one-token linear kernel (cpu_gemv.py). Imported only where numba is.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(inline="always")
def to_bf16(value):
    """An fp32 value's bf16 word, rounded to nearest even (a NaN stays a NaN)."""
    bits = np.uint32(np.float32(value).view(np.uint32))
    if bits & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16((bits + rounding) >> np.uint32(16))


@njit(inline="always")
def from_bf16(word):
    """A bf16 word's fp32 value (exact)."""
    return np.uint32(np.uint32(word) << np.uint32(16)).view(np.float32)


@njit
def rms_norm(x, weight, eps, out):
    """out = bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))), transformers' bf16 RMSNorm."""
    total = np.float32(0.0)
    for i in range(x.shape[0]):
        value = from_bf16(x[i])
        total += value * value
    variance = total / np.float32(x.shape[0])
    inverse = np.float32(1.0) / np.float32(math.sqrt(variance + eps))
    for i in range(x.shape[0]):
        normed = from_bf16(to_bf16(from_bf16(x[i]) * inverse))
        out[i] = to_bf16(from_bf16(weight[i]) * normed)


@njit
def rope(qkv, first_head, num_heads, head_dim, cos, signed_sin):
    """Rope in place on heads first_head .. first_head + num_heads - 1 of `qkv`."""
    half = head_dim // 2
    rotated = np.empty(head_dim, np.uint16)
    for head in range(first_head, first_head + num_heads):
        start = head * head_dim
        for d in range(head_dim):
            rolled = qkv[start + (d + half) % head_dim]
            rotated[d] = to_bf16(from_bf16(rolled) * from_bf16(signed_sin[d]))
        for d in range(head_dim):
            straight = to_bf16(from_bf16(qkv[start + d]) * from_bf16(cos[d]))
            qkv[start + d] = to_bf16(from_bf16(straight) + from_bf16(rotated[d]))


@njit
def add_into(hidden, other):
    """hidden += other, each sum rounded to bf16 (torch's in-place bf16 add)."""
    for i in range(hidden.shape[0]):
        hidden[i] = to_bf16(from_bf16(hidden[i]) + from_bf16(other[i]))


@njit
def silu_times_up(gate_up, intermediate, out):
    """out = bf16(bf16(silu(gate)) * up) for gate_up = gate | up (each `intermediate`)."""
    for i in range(intermediate):
        gate = from_bf16(gate_up[i])
        silu = from_bf16(to_bf16(gate / (np.float32(1.0) + np.float32(math.exp(-gate)))))
        out[i] = to_bf16(silu * from_bf16(gate_up[intermediate + i]))
