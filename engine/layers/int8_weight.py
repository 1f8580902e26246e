"""A linear layer's weight quantized to int8 when the model loads (`--quantization int8`:
weight-only, symmetric, one scale per output row), multiplied by the CPU kernels of
kernels/cpu_int8_linear.py (one token, the weight row-major) and kernels/cpu_panel_linear.py
(two tokens and more, a copy packed in panels: engine/layers/panel_weight.py).

    scale[o] = max_i |w[o, i]| / 127        (1.0 for a row of zeros)
    q[o, i]  = round(w[o, i] / scale[o])    in [-127, 127]
    y        = (x @ q^T) * scale + bias     in fp32, then x's dtype

The weight's bytes drop to a quarter of fp32's (half of bf16's), which is what a decode step's
linears are bound by; activations, the KV cache and the bias keep the engine's dtype. What the
rounding costs in accuracy is measured and bounded in tests/engine/test_quantized_weights.py.

Lifecycle: `Int8Weight.quantize` (from `Linear.pack`, once the checkpoint's weight is loaded;
the full-precision weight is then dropped), then one `__call__` per forward for any number of
tokens. The panel copy doubles the int8 bytes held (134 MB more on the default model); a
forward reads one of the two. CPU only: the model runner refuses `quantization="int8"` on CUDA
(engine/runner/model_runner.py).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.layers.panel_weight import PanelWeight
from pdserve.kernels import cpu_int8_linear

QMAX = 127


class Int8Weight:
    def __init__(
        self, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        self.quantized = quantized  # [out, in] int8
        self.scale = scale  # [out] fp32
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_array = (
            np.zeros(0, np.float32) if self.bias is None else self.bias.numpy()
        )
        self.panels = PanelWeight.for_weight(quantized, scale, self.bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight:
        """The int8 form of a CPU weight [out, in] of any float dtype (and its bias)."""
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"int8 weights are CPU matrices, got {weight.device} {weight.shape}")
        full = weight.detach().float()
        scale = full.abs().amax(dim=1) / QMAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        quantized = torch.round(full / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
        return cls(quantized.contiguous(), scale.contiguous(), bias)

    @property
    def num_bytes(self) -> int:
        """Bytes a forward streams: the int8 weight (or its panels, as many bytes but for the
        padding of a last panel), its scales and the bias."""
        total = self.quantized.numel() + self.scale.numel() * 4
        return total + (0 if self.bias is None else self.bias.numel() * 4)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this one stands for (tests, the accuracy bound)."""
        return self.quantized.float() * self.scale[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] of any float dtype -> [..., out] in x's dtype."""
        rows = x.reshape(-1, x.shape[-1]).float()
        if self.panels is not None and rows.shape[0] != 1:  # the row-major loop takes one
            out = self.panels(rows)
        elif cpu_int8_linear.int8_kernel_available():
            out = cpu_int8_linear.int8_linear(
                self.quantized.numpy(), self.scale.numpy(), rows, self._bias_array
            )
        else:
            out = cpu_int8_linear.reference(self.quantized, self.scale, rows, self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
