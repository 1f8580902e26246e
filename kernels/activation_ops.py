"""The small ops of a Llama-family decoder layer in numba code, on activations held as bf16
words (uint16) or as fp32, rounding as torch's ops round in that dtype: every op computes in
fp32, and on bf16 words rounds its result to bf16 (nearest even) where torch's bf16 op does.
Numba compiles each op once per activation type. Shared by the compiled decode paths
(cpu_decode_step.py: bf16, one token; cpu_decode_glue.py: bf16 or fp32, a batch). Imported
only where numba is.

  `widen(x)`           an element's fp32 value (a bf16 word widened; fp32 as it is)
  `narrow(v, like)`    the element of `like`'s type that fp32 `v` is stored as
  `rounded(v, like)`   `v` rounded as storing it in `like` would round it
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from pdserve.kernels.bf16_ops import from_bf16, to_bf16


def widen(value):
    """Python stand-in; numba compiles the overload below."""
    raise NotImplementedError("widen runs in numba code only")


def narrow(value, like):
    """Python stand-in; numba compiles the overload below."""
    raise NotImplementedError("narrow runs in numba code only")


def rounded(value, like):
    """Python stand-in; numba compiles the overload below."""
    raise NotImplementedError("rounded runs in numba code only")


def _holds_bf16_words(array_type) -> bool:
    return array_type.dtype == types.uint16


@overload(widen)
def _widen(value):
    if value == types.uint16:
        return lambda value: from_bf16(value)
    return lambda value: np.float32(value)


@overload(narrow)
def _narrow(value, like):
    if _holds_bf16_words(like):
        return lambda value, like: to_bf16(value)
    return lambda value, like: np.float32(value)


@overload(rounded)
def _rounded(value, like):
    if _holds_bf16_words(like):
        return lambda value, like: from_bf16(to_bf16(value))
    return lambda value, like: np.float32(value)


@njit
def rms_norm(x, weight, eps, out):
    """out = weight * (x * rsqrt(mean(x^2) + eps)), transformers' RMSNorm (in bf16: the
    normed value rounded, then the product)."""
    total = np.float32(0.0)
    for i in range(x.shape[0]):
        value = widen(x[i])
        total += value * value
    variance = total / np.float32(x.shape[0])
    inverse = np.float32(1.0) / np.float32(math.sqrt(variance + eps))
    for i in range(x.shape[0]):
        normed = rounded(widen(x[i]) * inverse, x)
        out[i] = narrow(widen(weight[i]) * normed, out)


@njit
def rope(qkv, first_head, num_heads, head_dim, cos, signed_sin):
    """Rope in place on heads first_head .. first_head + num_heads - 1 of `qkv`:
    x * cos + roll(x, head_dim / 2) * signed_sin, each product and the sum rounded."""
    half = head_dim // 2
    rotated = np.empty_like(cos)
    for head in range(first_head, first_head + num_heads):
        start = head * head_dim
        for d in range(head_dim):
            rolled = qkv[start + (d + half) % head_dim]
            rotated[d] = narrow(widen(rolled) * widen(signed_sin[d]), rotated)
        for d in range(head_dim):
            straight = rounded(widen(qkv[start + d]) * widen(cos[d]), qkv)
            qkv[start + d] = narrow(straight + widen(rotated[d]), qkv)


@njit
def add_into(hidden, other):
    """hidden += other, each sum rounded (torch's in-place add)."""
    for i in range(hidden.shape[0]):
        hidden[i] = narrow(widen(hidden[i]) + widen(other[i]), hidden)
