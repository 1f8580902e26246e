"""Attention backends by name: `torch` (reference, CPU) and later `triton` (GPU)."""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def attention_backend_class(name: str) -> type[AttentionBackend]:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"attention backend {name!r} is unknown; valid: {', '.join(sorted(ATTENTION_BACKENDS))}"
        ) from None
