"""Model registry: `config.architectures[0]` -> model class."""

from __future__ import annotations

from torch import nn

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
