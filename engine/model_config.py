"""What the model folder dictates: architecture, shapes, rope, stop tokens.

Parsed once from `config.json` (through transformers' AutoConfig) and `generation_config.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    hf_config: PretrainedConfig = field(repr=False)
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    config_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json")
        hf = AutoConfig.from_pretrained(path)
        architectures = getattr(hf, "architectures", None) or []
        if not architectures:
            raise ValueError(f"{path}/config.json names no `architectures`")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        model_type = hf.model_type
        attention_bias = bool(getattr(hf, "attention_bias", False))
        sliding_window = getattr(hf, "sliding_window", None)
        if model_type in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
            sliding_window = None
        config_dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = getattr(torch, config_dtype, None)
        return cls(
            path=path,
            hf_config=hf,
            architecture=architectures[0],
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", None) or 0,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            config_dtype=config_dtype if isinstance(config_dtype, torch.dtype) else None,
            eos_token_ids=_eos_token_ids(path, hf),
        )


def _eos_token_ids(path: Path, hf: PretrainedConfig) -> tuple[int, ...]:
    """Stop token ids: generation_config.json's eos_token_id, else config.json's."""
    eos = None
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)
