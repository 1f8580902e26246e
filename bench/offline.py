"""Offline throughput of pdserve vs Hugging Face transformers, on one model, dtype and machine.

What it measures (same dtype for both, same thread count, greedy decoding, one process). The
dtype is ``--dtype``; its default, auto, is what pdserve's ``--dtype auto`` picks on this machine
(bf16 on a CPU with AMX-BF16 or AVX512-BF16, else fp32; engine/cpu/dtype_choice.py), and
transformers runs in the same:

1. pdserve: ``LLM.generate`` on the whole workload at once (continuous batching, paged KV
   cache). Only the generate call is timed; engine construction and a tiny warm-up are not.
2. transformers ``generate()`` in left-padded static batches of ``--hf-batch-size`` requests
   (request order). Each batch runs to its longest ``max_tokens``; tokens past a request's own
   ``max_tokens`` are wasted work and are not counted.
3. transformers ``generate()`` one request at a time, on the first ``--hf-single-requests``
   requests only (it is slow); its rate is the measured one on those requests, nothing is
   extrapolated.

Workload: ``--num-requests`` requests with random token-id prompts (special tokens excluded);
prompt lengths uniform in [32, 512] and output lengths uniform in [16, 256], drawn from
``--seed``. Every request produces exactly its ``max_tokens`` (EOS is ignored), so "useful
output tokens" is the sum of the requests' ``max_tokens`` for every system.

With ``--quantization int8`` (or ``int4``) pdserve's linear weights are int8 (or 4-bit;
transformers keeps the model's, so parity is not expected). Also measured: pdserve's batch-1 decode step time against the read roofline (weight bytes a
decode step streams / the read bandwidth measured in the same run, the better of a streaming sum
and a large GEMV; see ``bench/bandwidth.py``; the goal is a step at >= 60% of it), the model's
linear layers alone at batch 1, a torch.profiler breakdown (engine phases and top ops by self
CPU time) of one prefill step, batched decode steps and batch-1 decode steps, and a parity
check: pdserve's greedy tokens vs transformers' batch-1 tokens on the requests that ran in (3).

The report is printed and written as markdown to ``--output``.

    python -m pdserve.bench.offline                       # full default run (10-20 min on 2 cores)
    python -m pdserve.bench.offline --num-requests 8 --hf-single-requests 2 --output /tmp/o.md
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

from pdserve.bench.bandwidth import measure_bandwidth
from pdserve.bench.decode_b1 import measure_decode_b1, time_linears_b1
from pdserve.bench.hf_baselines import load_hf_model, run_hf_batched, run_hf_single
from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.bench.parity import first_differences, parity_lines
from pdserve.bench.profiling import profile_decode, profile_decode_b1, profile_prefill
from pdserve.bench.report import build_report
from pdserve.bench.workload import Request, Throughput, greedy, make_workload
from pdserve.engine.config import QUANTIZATIONS

GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's current")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="of pdserve and transformers alike (auto: pdserve's choice on this machine)",
    )
    parser.add_argument(
        "--quantization", default=None, choices=QUANTIZATIONS,
        help="pdserve's weights only (`pdserve serve -q`); transformers keeps the model's",
    )
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-single-requests", type=int, default=16, metavar="K")
    parser.add_argument("--decode-steps", type=int, default=128, help="batch-1 timed steps")
    parser.add_argument("--profile-steps", type=int, default=5, help="decode steps profiled")
    parser.add_argument("--top-ops", type=int, default=12)
    parser.add_argument("--skip-hf-batched", action="store_true")
    parser.add_argument("--skip-hf-single", action="store_true")
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/offline.md")
    return parser.parse_args(argv)


def resolve_model(model: str | None) -> Path:
    if model is not None:
        return Path(model)
    from pdserve.model_store.default_model import ensure_default_model

    return ensure_default_model()


def build_llm(model_path: Path, args: argparse.Namespace) -> Any:
    from pdserve.engine import LLM

    return LLM(
        str(model_path),
        dtype=args.dtype,
        quantization=args.quantization,
        num_threads=args.threads,
        kv_cache_memory=int(args.kv_cache_gib * GIB),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )


def resolve_dtype(name: str, quantization: str | None = None) -> torch.dtype:
    """`--dtype`'s torch dtype; auto is engine/cpu/dtype_choice.py's choice on this CPU."""
    from pdserve.engine.cpu.dtype_choice import choose_dtype

    requested = None if name == "auto" else getattr(torch, name)
    return choose_dtype(requested, torch.device("cpu"), None, quantization=quantization).dtype


def run_pdserve(llm: Any, workload: list[Request]) -> tuple[Throughput, list[list[int]]]:
    llm.generate([r.prompt[:8] for r in workload[:4]], [greedy(4)] * min(4, len(workload)))
    params = [greedy(r.max_tokens) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in workload], params)
    seconds = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outputs]
    useful = sum(min(len(t), r.max_tokens) for t, r in zip(tokens, workload))
    computed = sum(len(t) for t in tokens)
    return Throughput("pdserve LLM.generate", len(workload), useful, computed, seconds), tokens


def say(message: str) -> None:
    print(f"[offline {time.strftime('%H:%M:%S')}] {message}", flush=True)


def bench_pdserve(
    args: argparse.Namespace, model_path: Path, results: dict[str, Any]
) -> tuple[list[Request], list[list[int]]]:
    """pdserve's part: throughput, batch-1 decode vs the floor, profiles. Fills `results`."""
    from pdserve.text.tokenizer import load_tokenizer

    say("loading pdserve")
    llm = build_llm(model_path, args)
    engine = llm.engine
    workload = make_workload(
        load_tokenizer(model_path),
        engine.model_config.vocab_size,
        args.num_requests,
        args.seed,
        tuple(args.prompt_len),
        tuple(args.output_len),
    )
    results["prompt_tokens"] = sum(len(r.prompt) for r in workload)
    results["weight_bytes"] = engine.runner.model.decode_weight_bytes()

    say(f"pdserve: generating {sum(r.max_tokens for r in workload):,} tokens")
    run, tokens = run_pdserve(llm, workload)
    results["runs"] = [run]
    results["preemptions"] = engine.scheduler.num_preemptions
    say(f"pdserve: {run.tokens_per_s:.1f} useful tok/s in {run.seconds:.1f} s")

    say("measuring memory bandwidth again, next to the batch-1 timing")
    results["bandwidth"] = results["bandwidth"].best_of(measure_bandwidth())
    say(f"pdserve: timing {args.decode_steps} batch-1 decode steps")
    b1_prompt = workload[0].prompt[:32]
    timing = measure_decode_b1(engine, b1_prompt, args.decode_steps)
    linears = time_linears_b1(engine.runner.model)
    results["decode"] = dataclasses.replace(timing, linears_s=linears)
    say(f"pdserve: batch-1 step {timing.median_step_s * 1e3:.1f} ms (median)")

    results["profiles"] = []
    if not args.skip_profile:
        say("profiling pdserve")
        results["profiles"] = [
            profile_prefill(engine, workload, args.max_num_batched_tokens, args.top_ops),
            profile_decode(engine, workload, args.profile_steps, args.top_ops),
            profile_decode_b1(engine, b1_prompt, 2 * args.profile_steps, args.top_ops),
        ]
    return workload, tokens


def bench_transformers(
    args: argparse.Namespace,
    model_path: Path,
    workload: list[Request],
    pdserve_tokens: list[list[int]],
    results: dict[str, Any],
) -> None:
    """transformers' part: static batches, batch 1 on the first K requests, parity."""
    results["parity"] = ["not checked (--skip-hf-single)"]
    if args.skip_hf_batched and args.skip_hf_single:
        return
    say("loading transformers")
    model = load_hf_model(model_path, resolve_dtype(args.dtype))
    if not args.skip_hf_batched:
        say(f"transformers: static batches of {args.hf_batch_size}")
        results["runs"].append(run_hf_batched(model, workload, args.hf_batch_size))
        say(f"transformers batched: {results['runs'][-1].tokens_per_s:.1f} useful tok/s")
    if not args.skip_hf_single:
        single = workload[: args.hf_single_requests]
        say(f"transformers: batch 1 on the first {len(single)} requests")
        run, hf_tokens = run_hf_single(model, single)
        results["runs"].append(run)
        say(f"transformers batch 1: {run.tokens_per_s:.1f} useful tok/s")
        results["parity"] = parity_lines(first_differences(pdserve_tokens, hf_tokens), workload)
        print("\n".join(results["parity"]), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    args.dtype = str(resolve_dtype(args.dtype, args.quantization)).removeprefix("torch.")
    torch.manual_seed(args.seed)
    results: dict[str, Any] = {"command": command_line(), "machine": machine_info()}
    model_path = resolve_model(args.model)
    results["model"] = model_path.name
    say(f"command: {results['command']}")
    say(f"machine: {results['machine']}")

    say("measuring memory bandwidth")
    results["bandwidth"] = measure_bandwidth()
    workload, pdserve_tokens = bench_pdserve(args, model_path, results)
    bench_transformers(args, model_path, workload, pdserve_tokens, results)
    results["machine"]["load average at end"] = load_average()

    report = build_report(results, args)
    print("\n" + report, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report, encoding="utf-8")
    say(f"report written to {args.output}")


if __name__ == "__main__":
    main()
