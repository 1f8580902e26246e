"""Linear layers: weights load in HF's [out, in] layout, then `pack()` converts them once into
the layout of the fastest kernel for the device.

On the CPU (fp32) that is pdserve's panels where numba runs (engine/layers/panel_weight.py:
1.34-1.64x oneDNN's prepacked matmul at 2 to 16 tokens, 0.84x at a 512-token prefill chunk,
bench/results/linear_batches_*.md), else oneDNN's prepacked matmul: measured on this project's
2-core CPU against the model's own shapes, it runs decode steps 2x faster than MKL's matmul at
batch 8 to 64, and matrix-vector products (batch 1) 15% faster. Elsewhere `F.linear` is already
the best.

bf16 weights are prepacked too, on a CPU with native bf16 matmuls (engine/cpu/cpu_features.py;
elsewhere oneDNN has no fast bf16 kernel and `F.linear` stays). Measured on a 2-core Xeon with
AMX-BF16 (torch 2.13), microseconds per call at SmolLM2-135M's shapes, by tokens in the batch:

    shape (in -> out)    tokens  fp32 packed  bf16 F.linear  bf16 packed
    qkv 576 -> 960            1        29           47            22
                             16        74           49            27
                             64       253           75            54
                            512     1,635          267           229
    o 576 -> 576              1        21           35            20
                            512     1,024          147           237
    gate_up 576 -> 3072       1       158          117            55
                             16       291          140            72
                            512     5,562          923           766
    down 1536 -> 576          1        58           66            27
                             64       460          124            72
                            512     2,674          513           678
    lm_head 576 -> 49152      1     2,984        2,119         1,335
                             16     6,904        2,517         1,547

Prepacked bf16 is 1.4-2.4x faster than `F.linear` up to 64 tokens, mixed at 512 (qkv and
gate_up 1.2x faster, o and down 1.3-1.6x slower) and even at 2,048. On the whole model
(`LLM.generate`), prepacking made batch-1 and batch-16 decode steps 1.2x faster and left
512-token prefill unchanged (within the 5% noise of the shared machine), so it stays.

One token at a time is bound by how fast the weights are read, and there a kernel of pdserve's
own (kernels/cpu_gemv.py, AVX512-BF16 dot products) reads them 1.29x faster than oneDNN's
prepacked matmul. It needs the weight row-major, which the prepacked layout is not, so on a CPU
where that kernel runs a bf16 layer keeps both: the prepacked weight for batches of two tokens
and more, a row-major copy for one token (`OneTokenWeight`). That doubles the memory of the
linear weights (269 MB more for SmolLM2-135M) for batch-1 decode steps 1.16-1.21x faster
(median engine.step() 27.4 -> 22.6 ms and 25.8 -> 22.3 ms, old and new code alternating).
The model keeps all its copies in one buffer on 2 MiB pages (engine/cpu/huge_pages.py), which the
kernel reads 1.13-1.23x faster than the same copies on 4 KiB pages.

fp32 weights get a row-major copy too, on any CPU numba compiles for (`Fp32OneTokenWeight`):
oneDNN's prepacked fp32 matmul reads one token's weights at about 13 GB/s at the default model's
shapes (2-core AMD EPYC held to AVX2), numba's loop (kernels/cpu_int8_linear.py) at 30-35 GB/s.
With the compiled step of engine/runner/fp32_one_token_step.py that made a batch-1 fp32 step
1.9x faster (32.6 -> 17.3 ms, bench/results/offline_fp32_epyc_zen4_as_avx2*.md), for 538 MB
more memory on the default model.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.cpu.cpu_features import detect_cpu_features
from pdserve.engine.layers.int4_weight import Int4Weight
from pdserve.engine.layers.int8_weight import Int8Weight
from pdserve.engine.layers.panel_weight import PanelWeight

QUANTIZED_FORMS = {"int8": Int8Weight, "int4": Int4Weight}  # by engine/config.py's QUANTIZATIONS


def onednn_packing_available(weight: torch.Tensor) -> bool:
    """fp32 on any CPU; bf16 on a CPU with native bf16 matmuls (oneDNN has no fast bf16
    kernel without them, and an engine there runs fp32 unless told otherwise)."""
    if weight.dtype == torch.bfloat16:
        packable_dtype = detect_cpu_features().native_bf16_matmul
    else:
        packable_dtype = weight.dtype == torch.float32
    return (
        weight.device.type == "cpu"
        and packable_dtype
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class OneTokenWeight:
    """A bf16 weight kept row-major for kernels/cpu_gemv.py, which multiplies one token by it
    (`for_weight` says None where that kernel cannot run, or not on this weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        from pdserve.kernels import cpu_gemv

        self.weight = weight.detach().contiguous()
        self.bias = torch.zeros(0, dtype=weight.dtype) if bias is None else bias.detach()
        self.weight_words = cpu_gemv.bf16_words(self.weight)
        self.bias_words = cpu_gemv.bf16_words(self.bias.contiguous())
        self._gemv = cpu_gemv.gemv_bf16

    @classmethod
    def for_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> OneTokenWeight | None:
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            return None
        from pdserve.kernels.cpu_gemv import cpu_gemv_available, gemv_fits

        return cls(weight, bias) if cpu_gemv_available() and gemv_fits(weight) else None

    @property
    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def move_into(self, memory: torch.Tensor) -> None:
        """Copies the weight into `memory` (flat bytes, `num_bytes` of them) and reads it from
        there from now on: the model gathers every copy onto huge pages this way
        (engine/cpu/huge_pages.py). The old copy is freed unless someone else holds it."""
        from pdserve.kernels import cpu_gemv

        moved = memory.view(self.weight.dtype).view(self.weight.shape)
        moved.copy_(self.weight)
        self.weight = moved
        self.weight_words = cpu_gemv.bf16_words(moved)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemv(x, self.weight_words, self.bias_words)


class Fp32OneTokenWeight:
    """An fp32 weight kept row-major for the one-token kernel of kernels/cpu_int8_linear.py, run
    with every row's scale 1 (an exact product): compiled by numba for the host's vectors, it
    reads the weights 2.3-2.7x faster than oneDNN's prepacked matmul does for one token (at the
    default model's shapes on a 2-core AMD EPYC held to AVX2: 30-35 against 13 GB/s), which is
    what a batch-1 decode step is bound by. `for_weight` says None where numba is missing. Same
    interface as `OneTokenWeight`, and `scale` and `bias` (None for none) as `Int8Weight` has
    them; the sums differ from oneDNN's only in their order."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach().contiguous()
        self.scale = torch.ones(weight.shape[0], dtype=torch.float32)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_array = np.zeros(0, np.float32) if self.bias is None else self.bias.numpy()

    @classmethod
    def for_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Fp32OneTokenWeight | None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        from pdserve.kernels.cpu_int8_linear import int8_kernel_available

        return cls(weight, bias) if int8_kernel_available() else None

    @property
    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def move_into(self, memory: torch.Tensor) -> None:
        """As `OneTokenWeight.move_into`."""
        moved = memory.view(self.weight.dtype).view(self.weight.shape)
        moved.copy_(self.weight)
        self.weight = moved

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pdserve.kernels.cpu_int8_linear import int8_linear

        return int8_linear(self.weight.numpy(), self.scale.numpy(), x, self._bias_array)


def one_token_weight(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> OneTokenWeight | Fp32OneTokenWeight | None:
    """The row-major copy a one-token forward reads, where a kernel for it runs."""
    if weight.dtype == torch.float32:
        return Fp32OneTokenWeight.for_weight(weight, bias)
    return OneTokenWeight.for_weight(weight, bias)


class Linear(nn.Module):
    """`dtype` None is torch's default dtype; the weight is left uninitialized (it is loaded).

    Lifecycle: built, loaded (`load`), then packed once (`pack`) into one of four forms: fp32
    panels for two tokens and more with a row-major copy for one token (fp32 on the CPU where
    numba runs: engine/layers/panel_weight.py), a oneDNN-prepacked weight (with a row-major
    copy for one-token steps where a kernel for it runs: bf16 with AVX512-BF16), a quantized
    weight (`pack("int8")`: engine/layers/int8_weight.py, `pack("int4")`: int4_weight.py), or
    the loaded weight as it is for `F.linear`."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.panels: PanelWeight | None = None
        self.one_token: OneTokenWeight | Fp32OneTokenWeight | None = None
        self.quantized: Int8Weight | Int4Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        if self.one_token is not None and x.dim() == 2 and x.shape[0] == 1:
            return self.one_token(x)
        if self.panels is not None:
            return self.panels(x)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward streams: the (packed) weight and the bias (a one-token forward
        streams the row-major copy instead: as many bytes)."""
        if self.quantized is not None:
            return self.quantized.num_bytes
        if self.panels is not None:
            weight = self.panels.panels
        elif self.packed_weight is not None:
            weight = self.packed_weight
        else:
            weight = self.weight
        total = weight.numel() * weight.element_size()
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        return total

    def pack(self, quantization: str | None = None) -> None:
        """Converts the loaded weight for the device's fastest kernels, or quantizes it
        (`quantization` "int8" or "int4"), and drops the original."""
        if self.weight is None:
            return  # packed already
        if quantization in QUANTIZED_FORMS:
            self.quantized = QUANTIZED_FORMS[quantization].quantize(self.weight.data, self.bias)
            self.weight = None
        elif quantization is not None:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        elif self.weight.dtype == torch.float32 and (
            panels := PanelWeight.for_weight(
                self.weight.data, torch.ones(self.out_features), self.bias
            )
        ):
            self.panels = panels
            self.one_token = one_token_weight(self.weight, self.bias)
            self.weight = None
        elif onednn_packing_available(self.weight):
            self.one_token = one_token_weight(self.weight, self.bias)
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, None)
            self.weight = None

    def huge_page_copies(
        self,
    ) -> list[PanelWeight | OneTokenWeight | Fp32OneTokenWeight | Int4Weight]:
        """The packed copies this layer reads that the model moves onto huge pages
        (`move_into`): its panels, one-token copy, or 4-bit panels; an int8 weight's panels."""
        copies = [self.one_token, self.panels]
        if isinstance(self.quantized, Int8Weight):
            copies.append(self.quantized.panels)
        elif isinstance(self.quantized, Int4Weight):
            copies.append(self.quantized)
        return [copy for copy in copies if copy is not None]

    def load(self, param_name: str, tensor: torch.Tensor, rows: slice = slice(None)) -> None:
        """Copies an HF weight [out, in] (or bias [out]) into output rows `rows`."""
        param = self.weight if param_name == "weight" else self.bias
        if param is None or param_name not in ("weight", "bias"):
            raise ValueError(f"unexpected parameter {param_name!r}")
        target = param.data[rows]
        if target.shape != tensor.shape:
            raise ValueError(
                f"{param_name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)


class FusedLinear(Linear):
    """Several HF projections stacked along the output (q|k|v, gate|up): one matmul for all."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: list[int],
        bias: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes), bias, dtype)
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)]

    @property
    def num_shards(self) -> int:
        return len(self.shard_offsets) - 1

    def load_shard(self, shard: int, param_name: str, tensor: torch.Tensor) -> None:
        start, end = self.shard_offsets[shard], self.shard_offsets[shard + 1]
        self.load(param_name, tensor, slice(start, end))
