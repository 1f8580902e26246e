"""CPU decode attention: the gather path (index_select of every block, small matmuls, a
softmax segmented by index_add_) vs the compiled in-place kernel (kernels/cpu_decode_attention.py),
side by side in one run.

1. Per layer call, on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, block size
   16) at batch 1, 16 and 64 and contexts 128, 512 and 2,048 tokens, plus a mixed batch of 64
   (lengths uniform in 1..2,048); shuffled block tables. Each number is the best of interleaved
   calls (old, new, old, new, ...): on a shared 2-core machine another process's burst stalls
   every two-thread parallel region it overlaps, which moved medians by up to 100x. The k/v
   store is excluded (both paths share it).
2. The one-time compile: a fresh process compiles the kernel for one cache dtype with an empty
   numba cache directory, then a second fresh process loads it from that directory.
3. A batch-64 decode step of the default model (engine.step(), greedy, EOS ignored): the median
   step time and the share of it spent in decode attention (both paths' calls timed inside the
   step, summed over the layers), the path switched between windows of steps on the same
   running batch.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.hooks import abort_all, patched, timed
from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.batch import build_flat_batch
from pdserve.engine.kv.kv_cache import KVCache, KVCacheSpec

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
COMPILE_SNIPPET = """
import sys, time, torch
from pdserve.kernels.cpu_decode_attention import cpu_decode_attention
dtype = getattr(torch, sys.argv[1])
q = torch.zeros(1, 9, 64)
cache = torch.zeros(1, 3, 16, 64, dtype=dtype)
one = torch.ones(1, 1, dtype=torch.int32)
start = time.perf_counter()
cpu_decode_attention(q, cache, cache, one - 1, one[0], 0.125)
print(time.perf_counter() - start)
"""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def decode_case(batch: int, seq_lens: list[int], dtype: torch.dtype, seed: int):
    """A backend over a one-layer cache holding `seq_lens` in shuffled blocks, the step's two
    metadata (gather, kernel) and a query; every token already decoded into the cache."""
    rng = random.Random(seed)
    counts = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(counts) + 1
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, used = [], 0
    for count in counts:
        tables.append(order[used : used + count])
        used += count
    spec = KVCacheSpec(1, KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype)
    cache = KVCache(spec, num_blocks, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=generator))
    backend = TorchAttentionBackend(cache, HEADS, KV_HEADS, HEAD_DIM, None)
    flat = build_flat_batch(
        [[1]] * batch, [n - 1 for n in seq_lens], tables, [True] * batch, BLOCK_SIZE,
        torch.device("cpu"),
    )
    kernel = backend.cpu_decode
    new_metadata = backend.prepare(flat).decode
    backend.cpu_decode = None
    old_metadata = backend.prepare(flat).decode
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return backend, kernel, old_metadata, new_metadata, q


def time_layer_calls(batch, seq_lens, dtype, seed, min_seconds) -> tuple[float, float, float]:
    """(old seconds, new seconds, max abs difference) per layer call."""
    backend, kernel, old_metadata, new_metadata, q = decode_case(batch, seq_lens, dtype, seed)
    key_cache, value_cache = backend.kv_cache.key_cache(0), backend.kv_cache.value_cache(0)
    new_out = torch.empty_like(q)

    def old() -> torch.Tensor:
        return backend._decode(q, key_cache, value_cache, old_metadata)

    def new() -> torch.Tensor:
        kernel.attend(0, q, key_cache, value_cache, new_metadata, new_out)
        return new_out

    difference = (old().float() - new().float()).abs().max().item()
    old_s: list[float] = []
    new_s: list[float] = []
    deadline = time.perf_counter() + min_seconds
    while len(old_s) < 5 or time.perf_counter() < deadline:
        for fn, sink in ((old, old_s), (new, new_s)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return min(old_s), min(new_s), difference


def compile_seconds(dtype_name: str) -> tuple[float, float]:
    """(first compile into an empty cache directory, load from it) in fresh processes."""
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
        runs = []
        for _ in range(2):
            result = subprocess.run(
                [sys.executable, "-c", COMPILE_SNIPPET, dtype_name],
                env=env, capture_output=True, text=True, check=True, timeout=600,
            )
            runs.append(float(result.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def engine_steps(args) -> list[tuple[str, float, float, int]]:
    """[(path, median step s, attention share, context at the end)] for a batch-64 decode."""
    from pdserve.engine import EngineConfig, SamplingParams
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads,
        max_num_seqs=args.step_batch,
    )
    engine = LLMEngine(config)
    backend = engine.runner.attention
    kernel = backend.cpu_decode
    if kernel is None:
        raise SystemExit("the compiled CPU decode kernel is not available in this engine")
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    windows = 2 * args.repeats
    total = args.warm_steps + windows * args.steps + 4
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    ids = [f"step-{i}" for i in range(args.step_batch)]
    for request_id in ids:
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        engine.add_request(request_id, prompt, params)
    while engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(args.warm_steps):
        engine.step()
    results: dict[str, tuple[list[float], list[float]]] = {"old": ([], []), "new": ([], [])}
    for window in range(windows):
        path = "old" if window % 2 == 0 else "new"
        backend.cpu_decode = kernel if path == "new" else None
        step_s, attention_s = results[path]
        calls: list[float] = []
        target = (kernel, "attend") if path == "new" else (backend, "_decode")
        with patched(*target, timed(calls)):
            for _ in range(args.steps):
                calls.clear()
                start = time.perf_counter()
                outputs = engine.step().outputs
                step_s.append(time.perf_counter() - start)
                attention_s.append(sum(calls))
                assert len(outputs) == args.step_batch, "a row finished early"
        say(f"{path}: {statistics.median(step_s[-args.steps:]) * 1e3:.1f} ms/step")
    backend.cpu_decode = kernel
    context = args.prompt_len + args.warm_steps + windows * args.steps
    abort_all(engine, ids)
    rows = []
    for path, (step_s, attention_s) in results.items():
        rows.append((path, statistics.median(step_s), sum(attention_s) / sum(step_s), context))
    return rows


def build_report(args, machine, layer_rows, compile_rows, step_rows, numba_info) -> str:
    lines = [
        "# CPU decode attention: gather path vs compiled in-place kernel",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine['cpu']}, {machine['cores']}; torch {machine['torch']}  ",
        f"Date: {machine['date']}; load average at start {machine['load average at start']}  ",
        f"numba {numba_info}; load average at end {machine['load average at end']}",
        "",
        "## Per layer call",
        "",
        (
            f"SmolLM2-135M's attention shapes ({HEADS} query heads, {KV_HEADS} KV heads, head "
            f"dim {HEAD_DIM}, block size {BLOCK_SIZE}); shuffled block tables; the best of "
            f"interleaved calls over at least {args.min_seconds:g} s per row (a shared machine: "
            "other processes' bursts stall two-thread parallel regions). Old: "
            "`TorchAttentionBackend._decode` (index_select of every block, matmuls, "
            "index_add_ softmax). New: kernels/cpu_decode_attention.py. Max diff: largest "
            "absolute difference between the two outputs (bf16 rows: both outputs are bf16, "
            "so they differ by bf16 roundings)."
        ),
        "",
        "| cache | batch | context | old | new | old / new | max diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, batch, context, old, new, difference in layer_rows:
        lines.append(
            f"| {dtype} | {batch} | {context} | {old * 1e3:.3f} ms | {new * 1e3:.3f} ms | "
            f"{old / new:.2f}x | {difference:.1e} |"
        )
    lines += [
        "",
        "## One-time compile",
        "",
        (
            "A fresh process, first call (numba compiles for the cache dtype and writes its "
            "cache), then a second fresh process with the same cache directory (loads it)."
        ),
        "",
        "| cache | first compile | loaded from the cache |",
        "|---|---:|---:|",
    ]
    for dtype, first, cached in compile_rows:
        lines.append(f"| {dtype} | {first:.2f} s | {cached:.2f} s |")
    if step_rows:
        context = step_rows[0][3]
        lines += [
            "",
            f"## Share of a batch-{args.step_batch} decode step",
            "",
            (
                f"Default model, {args.dtype}, {args.step_batch} requests with "
                f"{args.prompt_len}-token random prompts decoding greedily (context "
                f"{args.prompt_len}..{context} tokens); median `engine.step()` of "
                f"{args.repeats} windows of {args.steps} steps per path, the paths "
                "alternating on the same running batch; attention: the decode attention calls "
                "of every layer inside those steps."
            ),
            "",
            "| path | step | decode attention share |",
            "|---|---:|---:|",
        ]
        for path, step, share, _ in step_rows:
            name = "old (gather)" if path == "old" else "new (kernel)"
            lines.append(f"| {name} | {step * 1e3:.1f} ms | {share:.1%} |")
        old_step, new_step = step_rows[0][1], step_rows[1][1]
        lines += ["", f"Step time old / new: {old_step / new_step:.2f}x."]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.cpu_decode_attention")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype for the steps")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("--step-batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warm-steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run; writes nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.min_seconds = [1, 4], [40], 0.05
        args.step_batch, args.steps, args.repeats, args.prompt_len = 4, 2, 1, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    layer_rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        shapes = [(b, [c] * b, str(c)) for b in args.batches for c in args.contexts]
        rng = random.Random(args.seed)
        mixed_batch, longest = max(args.batches), max(args.contexts)
        shapes.append(
            (mixed_batch, [rng.randint(1, longest) for _ in range(mixed_batch)],
             f"mixed 1..{longest}")
        )
        for batch, seq_lens, label in shapes:
            old, new, difference = time_layer_calls(
                batch, seq_lens, dtype, args.seed, args.min_seconds
            )
            say(f"{name} batch {batch} context {label}: {old * 1e3:.3f} / {new * 1e3:.3f} ms")
            layer_rows.append((name, batch, label, old, new, difference))
    compile_rows = [(name, *compile_seconds(name)) for name in ("float32", "bfloat16")]
    import numba

    numba_info = f"{numba.__version__}, threading layer {numba.threading_layer()}"
    step_rows = engine_steps(args)
    machine["load average at end"] = load_average()
    text = build_report(args, machine, layer_rows, compile_rows, step_rows, numba_info)
    print(text)
    if not args.quick:
        (RESULTS / "cpu_decode_attention.md").write_text(text)
        say("wrote bench/results/cpu_decode_attention.md")


if __name__ == "__main__":
    main()
