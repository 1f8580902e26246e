"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor for the config's rope type."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        supported = sorted(set(ROPE_INIT_FUNCTIONS) - {"dynamic"} | {"default"})
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {supported}")
    return ROPE_INIT_FUNCTIONS[rope_type](config, None)


class RotaryEmbedding(nn.Module):
    """Applies rope to flat [T, heads, head_dim] queries and keys at arbitrary positions.

    `rotate_half(x) * sin` is computed as `roll(x, head_dim / 2) * signed_sin`, where signed_sin
    is sin with its first half negated: the same products bit for bit (negating one factor is
    exact), one roll in place of two slices, a negation and a concatenation.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        signed_sin = emb.sin() * scaling
        signed_sin[:, : head_dim // 2].neg_()
        self.register_buffer("cos_table", emb.cos() * scaling, persistent=False)
        self.register_buffer("signed_sin_table", signed_sin, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token [T, 1, head_dim] cos and signed sin, computed once per step and shared by
        all layers."""
        cos = self.cos_table.index_select(0, positions).to(dtype).unsqueeze(1)
        signed_sin = self.signed_sin_table.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, signed_sin

    @staticmethod
    def apply(
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, into `out` (x itself is allowed) when given, rounded
        after each op as transformers rounds it: `addcmul_` fuses the last two (one rounding,
        an FMA), which changes a quarter of fp32 and bf16 results by an ulp, and in bf16 that
        flips greedy tokens."""
        rotated = x.roll(x.shape[-1] // 2, -1).mul_(signed_sin)
        return torch.add(x * cos, rotated, out=out)
