"""A linear layer's weight quantized to 4 bits when the model loads (`--quantization int4`:
one fp16 scale and one fp16 minimum per output row and group of 32 inputs, round to nearest),
multiplied by kernels/cpu_int4_linear.py for any number of tokens, its inputs rounded to int8
per token and group inside the kernel.

    w ~ q * scale + minimum      q in 0 .. 15 (kernels/cpu_int4_linear.py's `quantize`)

A decode step reads 5 bits a weight: 0.63x of int8's bytes, 0.16x of fp32's. Activations, the
KV cache and the bias keep fp32. What the rounding costs in accuracy is measured and bounded
in tests/engine/test_quantized_weights.py. Side by side with int8 at one token (the default
model's 120 decoder matrices, 2-core Intel Xeon held to AVX2, from compiled code): 3.2 ms
against the int8 row-major loop's 5.0 ms.

Lifecycle: `Int4Weight.quantize` (from `Linear.pack`, once the checkpoint's weight is loaded;
the full-precision weight is then dropped), moved onto huge pages with the model's other copies
(`move_into`), then one `__call__` per forward. Without numba it computes the same in torch
(the kernel module's `reference`, slower). CPU only, as int8.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels import cpu_int4_linear


class Int4Weight:
    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        self.out_features = q.shape[0]
        self.panels = cpu_int4_linear.pack(q, scale, minimum)  # uint8, the kernel's layout
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_array = np.zeros(0, np.float32) if self.bias is None else self.bias.numpy()
        self._fallback = (
            None if cpu_int4_linear.int4_kernel_available() else (q, scale, minimum)
        )

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Weight:
        """The 4-bit form of a CPU weight [out, in] of any float dtype (and its bias)."""
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"int4 weights are CPU matrices, got {weight.device} {weight.shape}")
        return cls(*cpu_int4_linear.quantize(weight), bias)

    @property
    def num_bytes(self) -> int:
        """Bytes a forward streams: the panels (4-bit values, scales and minimums) and the bias."""
        return self.panels.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def move_into(self, memory: torch.Tensor) -> None:
        """Copies the panels into the start of `memory` (flat bytes, `num_bytes` of them) and
        reads them from there from now on (engine/cpu/huge_pages.py)."""
        moved = memory[: self.panels.numel()].view(self.panels.shape)
        moved.copy_(self.panels)
        self.panels = moved

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] of any float dtype -> [..., out] in x's dtype."""
        rows = x.reshape(-1, x.shape[-1]).float()
        if self._fallback is None:
            out = cpu_int4_linear.int4_linear(
                self.panels.numpy(), rows, self._bias_array, self.out_features
            )
        else:
            out = cpu_int4_linear.reference(*self._fallback, rows, self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
