"""Batch-1 decode timing: wall time of pdserve's engine.step() and of the model forward in it
for one decoding request, and of the model's linear layers alone, called back to back on a
[1, in_features] input (the kernel part of a decode step, the part the memory-bandwidth floor
bounds)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.bench.bandwidth import best_time
from pdserve.bench.hooks import abort_all, patched, timed
from pdserve.bench.workload import greedy


@dataclasses.dataclass(frozen=True)
class DecodeTiming:
    """Batch-1 decode: per-step wall times of engine.step() and of the model forward in it."""

    prompt_len: int
    step_s: list[float]
    forward_s: list[float]
    linears_s: float = 0.0  # the model's Linear layers alone, each called on a [1, in] input
    compiled: bool = False  # the forward was engine/runner/one_token_step.py's compiled step

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_forward_s(self) -> float:
        return statistics.median(self.forward_s)


def measure_decode_b1(engine: Any, prompt: list[int], num_steps: int) -> DecodeTiming:
    """Times engine.step() and the forward inside it - the model's, or the compiled one-token
    step where the runner has one - for one decoding request."""
    engine.add_request("bench-b1", prompt, greedy(num_steps + 2))
    engine.step()  # prefill, not timed
    step_s: list[float] = []
    forward_s: list[float] = []
    one_token = engine.runner.forward_path("one_token_step")
    compiled = one_token is not None
    forward = (one_token, "step") if compiled else (engine.runner.forward_path("model"), "model")
    with patched(*forward, timed(forward_s)):
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
    abort_all(engine, ["bench-b1"])
    return DecodeTiming(len(prompt), step_s, forward_s, compiled=compiled)


def linear_calls(model: torch.nn.Module) -> list[Callable[[], torch.Tensor]]:
    """One batch-1 call per engine Linear of the model (lm_head included), in module order."""
    from pdserve.engine.layers.linear import Linear

    calls: list[Callable[[], torch.Tensor]] = []
    for module in model.modules():
        if isinstance(module, Linear):
            if module.quantized is not None or module.panels is not None:  # fp32 activations
                dtype = torch.float32
            elif module.packed_weight is not None:
                dtype = module.packed_weight.dtype
            else:
                dtype = module.weight.dtype
            x = torch.randn(1, module.in_features, dtype=dtype)
            calls.append(lambda module=module, x=x: module(x))
    return calls


@torch.inference_mode()
def time_linears_b1(model: torch.nn.Module) -> float:
    """Batch-1 time of the model's Linear layers alone (best of 5): the kernel part of a decode
    step, without attention, norms, activations or Python glue between them."""
    calls = linear_calls(model)
    if not calls:
        raise RuntimeError("the model has no engine Linear layers to time")
    return best_time(lambda: [call() for call in calls], 5)
