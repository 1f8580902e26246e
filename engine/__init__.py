"""pdserve's engine core: paged KV cache, continuous batching, Llama-family models.

`LLM`, `RequestOutput` and `SamplingParams` are imported on first use, so `pdserve.engine.config`
(whose dataclass the command-line parsers are generated from) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdserve.engine.config import EngineConfig

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
_LAZY = {
    "LLM": "pdserve.engine.llm",
    "RequestOutput": "pdserve.engine.outputs",
    "SamplingParams": "pdserve.wire.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
