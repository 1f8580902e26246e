"""pdserve's engine core: paged KV cache, continuous batching, Llama-family models."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
