"""A linear layer's weight packed in panels (kernels/cpu_panel_linear.py) for forwards of two
tokens and more on the CPU: fp32 weights (engine/layers/linear.py, in place of oneDNN's
prepacked matmul) and int8 ones (engine/layers/int8_weight.py, in place of a row-major loop).

Why. Measured side by side on the default model's 120 decoder matrices (2-core Intel Xeon held
to AVX2, weights from memory, `python -m pdserve.bench.linear_batches`,
bench/results/linear_batches_xeon_amx_as_avx2.md), ms a round by tokens:

    tokens                      2      16      64     128     512
    fp32 oneDNN prepacked    26.2    49.9   116.7   196.4   693.6
    fp32 panels              19.6    30.5    99.7   177.7   821.3
    int8 panels               7.3    27.8   105.7   198.8   888.2

Panels multiply 16 tokens 1.64x faster than oneDNN in fp32; a 512-token prefill chunk runs at
0.84x its speed. The row-major int8 loop they replace took 37.6 ms at 16 tokens, against the
int8 panels' 26.6 ms, in an ad hoc run of the same hour. One-token forwards keep their row-major copies (linear.py's
`Fp32OneTokenWeight`, the int8 weight itself), which the compiled one-token step reads.

Lifecycle: built once from the loaded weight ([out, in] fp32, or int8 with its scales), moved
onto huge pages with the model's other copies (`move_into`), then one call per forward.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels import cpu_panel_linear


class PanelWeight:
    """`stored` [out, in] fp32 or int8 and `scale` [out] fp32 (ones for fp32): computes
    x @ (stored * scale[:, None]).T + bias for x [..., in] fp32."""

    def __init__(
        self, stored: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        self.out_features = stored.shape[0]
        self.panels = cpu_panel_linear.pack_panels(stored.detach())
        self.scale = scale.detach().float().contiguous()
        self._bias_array = (
            np.zeros(0, np.float32) if bias is None else bias.detach().float().contiguous().numpy()
        )

    @classmethod
    def for_weight(
        cls, stored: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> PanelWeight | None:
        """None where the kernel cannot run (no numba, not a CPU matrix of fp32 or int8)."""
        if (
            not cpu_panel_linear.panel_kernel_available()
            or stored.device.type != "cpu"
            or stored.dim() != 2
            or stored.dtype not in (torch.float32, torch.int8)
        ):
            return None
        return cls(stored, scale, bias)

    @property
    def num_bytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def move_into(self, memory: torch.Tensor) -> None:
        """Copies the panels into `memory` (flat bytes, `num_bytes` of them) and reads them from
        there from now on (engine/cpu/huge_pages.py, as linear.py's one-token copies)."""
        moved = memory.view(self.panels.dtype).view(self.panels.shape)
        moved.copy_(self.panels)
        self.panels = moved

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] fp32 -> [..., out] fp32."""
        rows = x.reshape(-1, x.shape[-1])
        out = cpu_panel_linear.panel_linear(
            self.panels.numpy(), self.scale.numpy(), rows, self._bias_array
        )
        return out.reshape(*x.shape[:-1], self.out_features)
