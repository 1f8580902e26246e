"""Where pdserve's time goes: torch.profiler runs (CPU) over a prefill step, batched decode
steps and batch-1 decode steps, summarized as engine phases (profiler ranges around the
scheduler, batch building, attention metadata, model and sampler) and top ops by self CPU time."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from pdserve.bench.hooks import abort_all, counted, labelled, patched, step_until
from pdserve.bench.workload import Request, greedy

PHASES = (
    "pd.step", "pd.schedule", "pd.build_batch", "pd.attn_prepare", "pd.model",
    "pd.one_token_step", "pd.decode_batch_step", "pd.sample",
)


@dataclasses.dataclass(frozen=True)
class OpRow:
    name: str
    self_ms_per_step: float
    share: float  # of all self CPU time in the profiled steps
    calls_per_step: float


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    title: str
    num_steps: int
    tokens_per_step: float
    wall_ms_per_step: float
    phases: list[tuple[str, float]]  # (label, CPU ms per step, children included)
    top_ops: list[OpRow]


@contextmanager
def labelled_phases(engine: Any) -> Iterator[None]:
    """Wraps the engine's phases in profiler ranges: schedule, batch, metadata, model (or the
    runner's compiled decode paths, where it has them), sample."""
    from pdserve.engine.runner import model_runner

    runner = engine.runner
    with ExitStack() as stack:
        stack.enter_context(patched(engine, "step", labelled("pd.step")))
        stack.enter_context(patched(engine.scheduler, "schedule", labelled("pd.schedule")))
        stack.enter_context(
            patched(model_runner, "build_flat_batch", labelled("pd.build_batch"))
        )
        stack.enter_context(patched(runner.attention, "prepare", labelled("pd.attn_prepare")))
        stack.enter_context(patched(runner.forward_path("model"), "model", labelled("pd.model")))
        for compiled in ("one_token_step", "decode_batch_step"):
            path = runner.forward_path(compiled)
            if path is not None:
                stack.enter_context(patched(path, "step", labelled(f"pd.{compiled}")))
        stack.enter_context(patched(runner, "sampler", labelled("pd.sample")))
        yield


def profile_steps(engine: Any, title: str, num_steps: int, top: int) -> ProfileSummary:
    """Profiles `num_steps` engine steps (CPU activities) and summarizes phases and ops."""
    from torch.profiler import ProfilerActivity, profile

    tokens: list[int] = []
    counting = patched(engine.scheduler, "schedule", counted(tokens))
    with counting, labelled_phases(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - start
    return summarize_profile(prof, title, num_steps, sum(tokens), wall, top)


def summarize_profile(
    prof: Any, title: str, num_steps: int, tokens: int, wall: float, top: int
) -> ProfileSummary:
    events = list(prof.key_averages())
    total_self = sum(e.self_cpu_time_total for e in events) or 1.0
    by_key = {e.key: e for e in events}
    phases = [
        (label, by_key[label].cpu_time_total / 1e3 / num_steps)
        for label in PHASES
        if label in by_key
    ]
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    rows = [
        OpRow(
            name=e.key,
            self_ms_per_step=e.self_cpu_time_total / 1e3 / num_steps,
            share=e.self_cpu_time_total / total_self,
            calls_per_step=e.count / num_steps,
        )
        for e in ranked
    ]
    return ProfileSummary(
        title, num_steps, tokens / num_steps, wall * 1e3 / num_steps, phases, rows
    )


def profile_prefill(engine: Any, workload: list[Request], budget: int, top: int) -> ProfileSummary:
    """One step of fresh prompts filling the token budget (pure prefill)."""
    ids, total = [], 0
    for i, request in enumerate(workload):
        if total >= budget:
            break
        engine.add_request(f"prof-p{i}", request.prompt, greedy(1))
        ids.append(f"prof-p{i}")
        total += len(request.prompt)
    summary = profile_steps(engine, "prefill step", 1, top)
    abort_all(engine, ids)
    return summary


def profile_decode(engine: Any, workload: list[Request], steps: int, top: int) -> ProfileSummary:
    """`steps` pure-decode steps with every workload request running."""
    ids = [f"prof-d{i}" for i in range(len(workload))]
    for request_id, request in zip(ids, workload):
        engine.add_request(request_id, request.prompt, greedy(steps + len(workload) + 64))
    scheduler = engine.scheduler
    step_until(
        engine,
        lambda: (
            not scheduler.waiting and all(s.num_uncomputed_tokens == 1 for s in scheduler.running)
        ),
    )
    title = f"decode steps, batch {len(scheduler.running)}"
    summary = profile_steps(engine, title, steps, top)
    abort_all(engine, ids)
    return summary


def profile_decode_b1(engine: Any, prompt: list[int], steps: int, top: int) -> ProfileSummary:
    engine.add_request("prof-b1", prompt, greedy(steps + 2))
    engine.step()
    summary = profile_steps(engine, "decode steps, batch 1", steps, top)
    abort_all(engine, ["prof-b1"])
    return summary
