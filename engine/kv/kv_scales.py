"""FP8 KV cache: per-layer scales, where they come from, and the store / read conversions.

vLLM's semantics: a layer's key `x` is stored as `fp8(x / k_scale)` and read as
`float(stored) * k_scale` (values with `v_scale`); the quotient is clamped to the fp8 range
(float8_e4m3fn: +-448) before the cast, so a value past the range saturates instead of becoming
NaN. A cache of the model's own dtype stores and reads values unchanged (no scale).

Scales come from the checkpoint when it holds them, under any of the names vLLM reads:
`model.layers.N.self_attn.k_scale` / `.v_scale` (also `.self_attn.attn.k_scale`),
`model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale`, and the deprecated
single `model.layers.N.self_attn.kv_scale` (both). A layer the checkpoint gives no scale gets
1.0, as in vLLM; which applies is logged once per engine. The loader leaves these tensors out
of the weights it hands the model (`is_kv_scale_name`).

The kernels (kernels/, which imports nothing of the project) take the same scale as a float
argument and do the same arithmetic in fp32: divide, clamp, cast on store; cast, multiply on
read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

_SCALE_NAME = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\."
    r"(?:(?:attn\.)?(k_scale|v_scale|kv_scale)|(k_proj|v_proj)\.output_scale)$"
)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale rather than a weight."""
    return _SCALE_NAME.match(name) is not None


@dataclass(frozen=True)
class KVScales:
    """One key scale and one value scale per layer; `source` says where they came from."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "default 1.0"

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"{len(self.k)} key scales for {len(self.v)} value scales")
        for scale in (*self.k, *self.v):
            if not (scale > 0 and scale < float("inf")):
                raise ValueError(f"a KV cache scale must be positive and finite, got {scale}")

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @classmethod
    def from_tensors(cls, named: Iterable[tuple[str, torch.Tensor]], num_layers: int) -> KVScales:
        """Scales from (checkpoint name, tensor) pairs; names that are not scales are skipped,
        layers without one get 1.0. A scale tensor holds one value (a per-tensor scale)."""
        k, v = [1.0] * num_layers, [1.0] * num_layers
        found = 0
        for name, tensor in named:
            match = _SCALE_NAME.match(name)
            if match is None:
                continue
            layer = int(match.group(1))
            if layer >= num_layers:
                raise ValueError(
                    f"KV scale {name!r} names layer {layer}; the model has {num_layers}"
                )
            if tensor.numel() != 1:
                raise ValueError(
                    f"KV scale {name!r} has {tensor.numel()} values; only per-tensor scales "
                    "(one value per layer) are supported"
                )
            value = float(tensor.float().item())
            kind = match.group(2) or {"k_proj": "k_scale", "v_proj": "v_scale"}[match.group(3)]
            if kind in ("k_scale", "kv_scale"):
                k[layer] = value
            if kind in ("v_scale", "kv_scale"):
                v[layer] = value
            found += 1
        if not found:
            return cls(tuple(k), tuple(v))
        return cls(tuple(k), tuple(v), f"checkpoint ({found} scale tensors)")


def read_kv_scales(folder: Path, num_layers: int) -> KVScales:
    """The scales a model folder's *.safetensors hold (only the scale tensors are read)."""
    from safetensors import safe_open

    def named() -> Iterable[tuple[str, torch.Tensor]]:
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if is_kv_scale_name(name):
                        yield name, f.get_tensor(name)

    return KVScales.from_tensors(named(), num_layers)


def kv_scales_for(
    cache_dtype: torch.dtype, folder: Path | None, num_layers: int, load_format: str
) -> KVScales:
    """The scales an engine uses: 1.0 for a cache in the model's dtype (never applied), else
    the checkpoint's (dummy weights: none), logged."""
    if not is_fp8(cache_dtype):
        return KVScales.ones(num_layers)
    scales = KVScales.ones(num_layers)
    if load_format != "dummy" and folder is not None:
        scales = read_kv_scales(folder, num_layers)
    logger.info(
        "KV cache %s: per-layer scales from %s (k %.4g..%.4g, v %.4g..%.4g)",
        cache_dtype,
        scales.source,
        min(scales.k),
        max(scales.k),
        min(scales.v),
        max(scales.v),
    )
    return scales


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x` as the cache stores it: unchanged for a cache of its own kind, else
    fp8(clamp(x / scale)) computed in fp32."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    scaled = x.float() / scale
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def dequantize(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache's `stored` elements mean, in `dtype`: float(stored) * scale for fp8."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    values = stored.float()
    if scale != 1.0:
        values.mul_(scale)
    return values.to(dtype)
