"""Attention backends by name: `torch` (reference, the CPU default) and `triton` (GPU kernels).

Each entry loads its class on first use, so choosing `torch` never imports triton.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.attention.torch_backend import TorchAttentionBackend


def _triton_backend() -> type[AttentionBackend]:
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


ATTENTION_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {
    "torch": lambda: TorchAttentionBackend,
    "triton": _triton_backend,
}


def check_attention_backend(name: str) -> None:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is unknown; valid: {', '.join(sorted(ATTENTION_BACKENDS))}"
        )


def attention_backend_class(name: str) -> type[AttentionBackend]:
    check_attention_backend(name)
    return ATTENTION_BACKENDS[name]()
