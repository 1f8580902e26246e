"""A linear layer whose weight is stored as int8 with one fp32 scale per output row (weight-only
quantization: `--quantization int8`), for one token (a batch-1 decode step) on any CPU, compiled
by numba for the host's vector instructions (AVX2, AVX-512, NEON alike). Two tokens and more go
through the panels of kernels/cpu_panel_linear.py.

Why. A batch-1 decode step reads every weight once, so its linears are bound by the weights'
bytes. int8 has a quarter of fp32's bytes: SmolLM2-135M's linears read 134 MB a step
instead of 537 MB.

The same compiled code multiplies an fp32 weight given with scales of one (numba compiles it
once per weight type): engine/layers/linear.py's `Fp32OneTokenWeight` runs one-token fp32
forwards through it, exact but for the order of the sums.

What it computes, for x [1, in] fp32 (t = 0):
    y[t, o] = scale[o] * sum_i(weight[o, i] * x[t, i]) + bias[o]
the same as `reference` (the torch reference below: dequantize, then `F.linear`) up to the
order of the fp32 sums.

How. The rows of the weight are split over numba's threads in contiguous runs. Each thread
reads its rows one after the other, widening each int8 to fp32 into one running
sum per row (LLVM vectorizes the loop for the host's widest registers; fastmath lets it reorder
the sum): one sequential stream per thread. Reading four rows at once instead ran at 15 GB/s
against 22-24 GB/s on the default model's weights (2-core AMD EPYC). Before each row the thread
asks for the cache lines PREFETCH_BYTES ahead (llvm.prefetch): without it a thread's stream
waited on each row's lines. On a 2-core Intel Xeon held to AVX2, both threads reading 106 MB of
int8 rows of 576 went from 12-17 GB/s to 28-32 GB/s with 8 KiB ahead (4 KiB: 19-21 GB/s, 16 KiB:
28-30, 32-64 KiB: 20-31), 425 MB of fp32 rows from 25-26 to 30-31 GB/s; the batch-1 decode step
of the default model went from 14.3 to 10.1 ms in int8 and from 33.1 to 27.2 ms in fp32
(bench/results/offline_prefetch_*).

Measured on a 2-core AMD EPYC (Zen 4): one round of the default model's 121 matrices at one
token, weights from memory, 7.7 ms against 23.2 ms for oneDNN's prepacked fp32 matmul (the
engine's exact path, engine/layers/linear.py) and 12.8 ms for its bf16 one, side by side in
`python -m pdserve.bench.gemv_b1` (bench/results/gemv_b1_epyc_zen4.md).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

try:
    import numba
    from numba import prange

    from pdserve.kernels.llvm_prefetch import CACHE_LINE_BYTES, prefetch_element
    from pdserve.kernels.numba_compile import compiled
    from pdserve.kernels.numba_threads import run_parallel
except ImportError:  # engine/layers/int8_weight.py dequantizes instead
    numba = None

PREFETCH_BYTES = 8192  # how far ahead of its row a thread of the one-token loop asks for lines


def reference(
    weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What the kernel computes, in torch: int8 weight [out, in], scale [out] fp32."""
    return F.linear(x.float(), weight.float() * scale[:, None], bias)


if numba is not None:

    def _one_token(weight, scale, x, bias, out, num_chunks):
        """num_chunks: one per thread, each a contiguous run of rows read one row at a time."""
        num_rows, in_features = weight.shape
        per_chunk = (num_rows + num_chunks - 1) // num_chunks
        ahead = PREFETCH_BYTES // weight.itemsize
        line = CACHE_LINE_BYTES // weight.itemsize
        for chunk in prange(num_chunks):
            for row in range(chunk * per_chunk, min(num_rows, (chunk + 1) * per_chunk)):
                for index in range(row * in_features, (row + 1) * in_features, line):
                    prefetch_element(weight, index + ahead)
                total = np.float32(0.0)
                for i in range(in_features):
                    total += np.float32(weight[row, i]) * x[0, i]
                out[0, row] = total * scale[row]
                if bias.shape[0] != 0:
                    out[0, row] += bias[row]

    one_token_kernel = compiled(_one_token, parallel=True, fastmath=True)


def int8_linear(
    weight: np.ndarray, scale: np.ndarray, x: torch.Tensor, bias: np.ndarray
) -> torch.Tensor:
    """x [1, in] fp32 -> [1, out] fp32, `weight` [out, in] int8 (or fp32) and `scale` [out]
    fp32 numpy views, `bias` [out] fp32 (empty for none). Unchecked: engine/layers/int8_weight.py
    checks once, when it quantizes the weight; more tokens go through kernels/cpu_panel_linear.py."""
    if x.shape[0] != 1:
        raise ValueError(f"the row-major loop takes one token, got {x.shape[0]}")
    x = x.contiguous()
    out = torch.empty(1, weight.shape[0], dtype=torch.float32)
    run_parallel(
        one_token_kernel, weight, scale, x.numpy(), bias, out.numpy(), torch.get_num_threads()
    )
    return out


def int8_kernel_available() -> bool:
    return numba is not None
