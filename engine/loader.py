"""Builds a model from a folder: class from the registry, weights from *.safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.model_config import ModelConfig
from engine.models import model_class


def iterate_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors weights")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_model(
    config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    cls = model_class(config)
    with torch.device(device):
        model = cls(config, max_positions)
    model.to(dtype=dtype)
    model.rotary.to(dtype=torch.float32)
    model.load_weights(iterate_safetensors(config.path))
    return model.eval().requires_grad_(False)
