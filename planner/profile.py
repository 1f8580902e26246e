"""`pdserve profile`: measures one node of a model on this device, in this process, with the
real engine (the configuration a node starts with, the prefix cache off so that every prompt
token is computed), and writes a profile (planner/profile_file.py).

For each thread count (on a CPU host: one core and every usable core, the shares a node of
a deployment gets; on a GPU: one table):
  prefill  one prompt of each size (up to the step budget) per step;
  decode   `batch` prompts of each context length prefilled, then timed decode steps at each
           batch size, largest first, aborting requests to shrink the batch.
Each point is timed `repeats` times and keeps the median: on a shared host other processes
add outliers, which a least-squares fit would follow.
And once: a copy of a KV-sized buffer (the bandwidth a KV transfer is charged), the KV bytes
per token and the KV cache's capacity. The grid is fixed, so the run time is bounded: about a
minute for the default model on 2 CPU cores, a few seconds with `quick`.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch

from pdserve.bench.machine import machine_info
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.planner.profile_file import Profile, StepSample, ThreadTable
from pdserve.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]  # largest first
    repeats: int  # timings per point; the median is kept (other processes add outliers)
    copy_bytes: int


FULL = ProfileGrid((64, 256, 1024, 2048), (128, 768), (6, 3, 1), 3, 64 << 20)
QUICK = ProfileGrid((16, 64), (32,), (2, 1), 2, 1 << 20)
QUICK_KV_CACHE_BYTES = 16 << 20


def default_threads() -> list[int | None]:
    """One core and every usable core on a CPU host; the device's own on a GPU."""
    if torch.cuda.is_available():
        return [None]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return sorted({1, cores or 1})


def measure_profile(
    model: str | None, quick: bool = False, threads: list[int | None] | None = None
) -> Profile:
    grid = QUICK if quick else FULL
    started = time.perf_counter()
    kv_memory = QUICK_KV_CACHE_BYTES if quick else None  # a tiny model's default cache is huge
    engine = LLMEngine(
        EngineConfig(model=model, enable_prefix_caching=False, kv_cache_memory=kv_memory)
    )
    try:
        engine.warm_up()
        prompts = _Prompts(engine.model_config.vocab_size)
        tables = []
        before = torch.get_num_threads()
        for count in threads or default_threads():
            if count is not None:
                torch.set_num_threads(count)
            steps = _prefill_steps(engine, prompts, grid) + _decode_steps(engine, prompts, grid)
            tables.append(ThreadTable(count, steps))
            logger.info("profiled %s threads: %d steps", count, len(steps))
        torch.set_num_threads(before)
        spec = engine.runner.kv_cache.spec
        return Profile(
            model=engine.model_path.name,
            dtype=str(engine.runner.dtype).removeprefix("torch."),
            device=str(engine.runner.device),
            block_size=engine.config.block_size,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            kv_bytes_per_token=spec.bytes_per_block // engine.config.block_size,
            kv_capacity_tokens=engine.block_manager.num_blocks * engine.config.block_size,
            transfer_bytes_per_s=_copy_bandwidth(grid.copy_bytes, engine.runner.device),
            tables=tables,
            machine=machine_info(),
            seconds=time.perf_counter() - started,
        )
    finally:
        engine.close()


class _Prompts:
    """Distinct random prompts (ids past the first few, which tokenizers keep for specials)."""

    def __init__(self, vocab_size: int) -> None:
        self.generator = torch.Generator().manual_seed(0)
        self.vocab_size = vocab_size
        self.ids = itertools.count()

    def next(self, tokens: int) -> tuple[str, list[int]]:
        ids = torch.randint(3, self.vocab_size, (tokens,), generator=self.generator)
        return f"profile-{next(self.ids)}", ids.tolist()


def _timed_step(engine: LLMEngine) -> tuple[float, list]:
    started = time.perf_counter()
    outputs = engine.step().outputs
    engine.runner.synchronize()
    return time.perf_counter() - started, outputs


def _prefill_steps(engine: LLMEngine, prompts: _Prompts, grid: ProfileGrid) -> list[StepSample]:
    samples = []
    budget = engine.config.max_num_batched_tokens
    for tokens in grid.prefill_tokens:
        tokens = min(tokens, budget, engine.max_model_len - 1)
        times = []
        for _ in range(grid.repeats):
            request_id, ids = prompts.next(tokens)
            engine.add_request(request_id, ids, SamplingParams(max_tokens=1, ignore_eos=True))
            times.append(_timed_step(engine)[0])
            while engine.has_unfinished_requests():
                engine.step()
        samples.append(StepSample.prefill(tokens, 0, statistics.median(times)))
    return samples


def _decode_steps(engine: LLMEngine, prompts: _Prompts, grid: ProfileGrid) -> list[StepSample]:
    samples = []
    for context in grid.contexts:
        context = min(context, engine.max_model_len // 2)
        generated: dict[str, int] = {}
        for _ in range(grid.batches[0]):
            request_id, ids = prompts.next(context)
            max_tokens = engine.max_model_len - context
            engine.add_request(request_id, ids, SamplingParams(max_tokens=max_tokens,
                                                               ignore_eos=True))
            generated[request_id] = 0
        while min(generated.values()) == 0:  # every prompt computed
            for output in engine.step().outputs:
                generated[output.request_id] += len(output.new_token_ids)
        for batch in grid.batches:
            while len(generated) > batch:
                engine.abort_request(generated.popitem()[0])
            for output in engine.step().outputs:  # untimed: the batch's first step
                generated[output.request_id] += len(output.new_token_ids)
            times, attended = [], []
            for _ in range(grid.repeats):
                # each sequence attends to its prompt, its tokens so far and the new one
                attended.append(sum(context + n for n in generated.values()))
                seconds, outputs = _timed_step(engine)
                times.append(seconds)
                for output in outputs:
                    generated[output.request_id] += len(output.new_token_ids)
            samples.append(StepSample(0, 0, len(generated), int(statistics.median(attended)),
                                      statistics.median(times)))
        for request_id in generated:
            engine.abort_request(request_id)
        engine.step()
    return samples


def _copy_bandwidth(num_bytes: int, device: torch.device) -> float:
    """Bytes per second of copying a KV-sized buffer once (the best of three)."""
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return num_bytes / max(min(times), 1e-9)


def summary_rows(profile: Profile) -> list[list[str]]:
    """Per thread count: prefill tokens/s at each prompt size, decode ms at each batch."""
    rows = []
    for table in profile.tables:
        prefill = ", ".join(
            f"{s.prefill_tokens}: {s.prefill_tokens / s.seconds:,.0f}"
            for s in table.steps if s.prefill_tokens
        )
        decode: dict[tuple[int, int], list[float]] = {}
        for s in table.steps:
            if s.decode_seqs:
                key = (s.decode_seqs, round(s.decode_context / s.decode_seqs, -1))
                decode.setdefault(key, []).append(s.seconds)
        decode_text = ", ".join(
            f"{b}x{c:.0f}: {statistics.median(v) * 1e3:.1f}" for (b, c), v in decode.items()
        )
        rows.append([str(table.threads or "default"), prefill, decode_text])
    return rows
