"""The transformers baselines: ``generate()`` in left-padded static batches, and one request at
a time. Greedy, EOS disabled, exactly each batch's longest ``max_tokens`` generated."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.workload import Request, Throughput


def load_hf_model(model_path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The same checkpoint through transformers in `dtype`, with EOS disabled (no early
    stops)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    model.eval()
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad if isinstance(pad, int) else next(iter(pad))
    return model


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy generate of exactly `new_tokens` tokens for each (left-padded) prompt."""
    ids, mask = left_pad(prompts, model.generation_config.pad_token_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    generated = out[:, ids.shape[1] :]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"transformers generated {generated.shape[1]} != {new_tokens} tokens")
    return generated.tolist()


def run_hf_batched(model: Any, workload: list[Request], batch_size: int) -> Throughput:
    hf_generate(model, [workload[0].prompt[:8]] * 2, 4)  # warm-up
    useful = computed = 0
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first : first + batch_size]
        longest = max(r.max_tokens for r in batch)
        hf_generate(model, [r.prompt for r in batch], longest)
        useful += sum(r.max_tokens for r in batch)
        computed += longest * len(batch)
    seconds = time.perf_counter() - start
    name = f"transformers static batch {batch_size}"
    return Throughput(name, len(workload), useful, computed, seconds)


def run_hf_single(model: Any, workload: list[Request]) -> tuple[Throughput, list[list[int]]]:
    hf_generate(model, [workload[0].prompt[:8]], 4)  # warm-up
    tokens = []
    start = time.perf_counter()
    for request in workload:
        tokens.append(hf_generate(model, [request.prompt], request.max_tokens)[0])
    seconds = time.perf_counter() - start
    useful = sum(r.max_tokens for r in workload)
    name = f"transformers batch 1 (first {len(workload)} requests)"
    return Throughput(name, len(workload), useful, useful, seconds), tokens
