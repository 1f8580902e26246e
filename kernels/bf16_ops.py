"""bf16 numbers as 16-bit words in numba code, and the MLP's SiLU times up on them, rounding as
torch's bf16 ops round: each op computes in fp32 and rounds its result to bf16 (nearest even).
Shared by the compiled decode paths (cpu_decode_step.py, and activation_ops.py's ops on bf16
words) and the one-token linear kernel (cpu_gemv.py). Imported only where numba is.
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
def silu_times_up(gate_up, intermediate, out):
    """out = bf16(bf16(silu(gate)) * up) for gate_up = gate | up (each `intermediate`)."""
    for i in range(intermediate):
        gate = from_bf16(gate_up[i])
        silu = from_bf16(to_bf16(gate / (np.float32(1.0) + np.float32(math.exp(-gate)))))
        out[i] = to_bf16(silu * from_bf16(gate_up[intermediate + i]))
