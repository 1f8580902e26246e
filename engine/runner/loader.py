"""Builds a model from a folder: class from the registry, weights by load format.

Load formats (`EngineConfig.load_format`):
  "auto":  weights from the folder's *.safetensors;
  "dummy": random weights drawn from `seed` (the folder needs only config.json), to measure
           speed and memory with a model's shapes where its weights cannot be had.
Either way every parameter is created directly in the target dtype on the target device (the
model classes take a `dtype`), so loading never holds the weights twice: a bf16 model never
exists in fp32, and a checkpoint tensor of another dtype is converted on the host, one tensor
at a time, before it is copied in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.config import LOAD_FORMATS
from pdserve.engine.distributed.group import RankGroup
from pdserve.engine.distributed.layout import ShardLayout
from pdserve.engine.kv.kv_scales import is_kv_scale_name
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import model_class

DEFAULT_DUMMY_WEIGHT_STD = 0.02


def iterate_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} holds no *.safetensors weights (load format 'dummy' makes random ones "
            "from config.json alone)"
        )
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def build_model(
    config: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str,
    layout: ShardLayout | None = None,
    group: RankGroup | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """The model's modules with uninitialized weights in `dtype` on `device`; the "meta"
    device allocates nothing (shapes and parameter counts of any size of model). `layout`
    and `group`: a tensor-parallel rank's shard (None: the whole model). `quantization`: what
    the linears become once loaded (None: `dtype`, packed for the device)."""
    with torch.device(device):
        architecture = model_class(config)
        if layout is None:
            return architecture(config, max_positions, dtype=dtype, quantization=quantization)
        return architecture(
            config, max_positions, dtype=dtype, layout=layout, group=group,
            quantization=quantization,
        )


def load_model(
    config: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    layout: ShardLayout | None = None,
    group: RankGroup | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """Under tensor parallelism (`layout`, `group`) each rank reads every tensor and keeps its
    part; dummy weights are then drawn per rank in its shard's shapes (random either way, but
    not the one-rank model's)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model = build_model(config, max_positions, dtype, device, layout, group, quantization)
    if load_format == "dummy":
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        std = getattr(config.hf_config, "initializer_range", None) or DEFAULT_DUMMY_WEIGHT_STD
        model.load_random_weights(generator, std)
    else:
        model.load_weights(  # KV cache scales are read by engine/kv/kv_scales.py instead
            (name, tensor.to(dtype))
            for name, tensor in iterate_safetensors(config.path)
            if not is_kv_scale_name(name)
        )
    return model.eval().requires_grad_(False)
