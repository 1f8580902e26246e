"""Threads per node on a CPU host: cores an idle role strands against what sharing them costs.

    python -m pdserve.bench.thread_layout [--quick] [--output FILE]

On a CPU host `pdserve serve` runs each node with some number of torch threads. Giving 1P1D's
two nodes a disjoint share of the cores each isolates them (a prefill burst cannot slow a decode
step) but strands the prefill node's share whenever it has nothing to prefill, which with short
prompts is nearly always; giving every node all the cores lets the busy node use them, at the
price of interference when both are busy. This measures both sides on this machine:

* layouts: 1P1D with `cores / 2` threads per node (disjoint shares), 1P1D with `cores` threads
  per node (every node all the cores), 1P1D as `pdserve serve` lays it out by default
  (disjoint shares, the decode node borrowing every core while none of its prompts is being
  prefilled: commands/node_threads.py), and colocated with `cores` threads as the reference;
* workloads, in turn on one freshly started and warmed server per layout: closed-loop random
  prompts (32 tokens in, 128 out, EOS ignored) at concurrency 1, 16 and 64, where prefill is a
  small fraction of the work; and the long-prompt Poisson mix of bench/disagg_vs_colocated.py
  (30% prompts of 1,400-1,600 tokens with 16 tokens out, the rest 50-150 tokens with 200 out),
  where prefill bursts overlap decoding - the case for isolation;
* per workload: output tokens/s, TTFT, TPOT and ITL at P50 and P99, and the cores each process
  used (its CPU seconds from /proc over the run's wall time).

Writes the markdown report (machine, command, a table per workload with the ratios of the
other 1P1D layouts to the disjoint one) to --output, bench/results/thread_layout.md by default.
About 15 minutes on a 2-core CPU; `--quick` is a one-minute smoke run that writes nothing
unless --output is given.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.disagg_vs_colocated import make_requests as mixed_requests
from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.bench.report import md_table
from pdserve.bench.serve_datasets import RandomSpec, random_requests, warmup_requests
from pdserve.bench.serve_load import LoadOptions, LoadRequest, run_load, summarize
from pdserve.bench.serve_vocab import load_vocabulary
from pdserve.bench.server_processes import server_processes
from pdserve.engine.cpu.cpu_features import usable_cores

RESULTS = Path(__file__).parent / "results"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[LoadRequest]
    max_concurrency: int | None


def layouts(cores: int) -> dict[str, list[str]]:
    """Layout name -> `pdserve serve` flags; the first is the one the others are compared to."""
    share = max(1, cores // 2)
    disaggregated = ["--prefill", "1", "--decode", "1"]
    return {
        f"1P1D, {share}+{share} threads": [*disaggregated, "--threads-per-node", str(share)],
        f"1P1D, {cores}+{cores} threads": [*disaggregated, "--threads-per-node", str(cores)],
        f"1P1D default: {share}+{share}, decode borrows {cores} while prefill idles": disaggregated,
        f"colocated, {cores} threads": ["--colocated", "--threads-per-node", str(cores)],
    }


def workloads(args: argparse.Namespace, vocab: list[int]) -> list[Workload]:
    spec = RandomSpec(args.input_len, args.output_len)
    runs = [
        Workload(
            f"random {args.input_len} in / {args.output_len} out, concurrency {concurrency}",
            random_requests(spec, max(4, concurrency * args.waves), vocab, f"c{concurrency}"),
            concurrency,
        )
        for concurrency in args.concurrency
    ]
    for rate in args.mix_rates:
        runs.append(
            Workload(
                f"long-prompt Poisson mix, {rate:g} requests/s",
                mixed_requests(vocab, args.mix_requests, rate, args),
                None,
            )
        )
    return runs


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, every thread counted (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def run_layout(flags: list[str], runs: list[Workload], vocab: list[int], model: str | None):
    """One server for the layout, every workload in turn: {workload: summary + cores used}."""
    from pdserve.commands.serve_process import ServeProcess

    server = ServeProcess([*(["--model", model] if model else []), *flags], quiet=True)
    try:
        pids = server_processes(server.process.pid)
        run_load(server.url, warmup_requests(2, vocab, 0))
        results = {}
        for run in runs:
            before = {label: cpu_seconds(pid) for label, pid in pids.items()}
            options = LoadOptions(max_concurrency=run.max_concurrency)
            timings, wall = run_load(server.url, run.requests, options)
            summary = summarize(timings, wall)
            summary["cores"] = {
                label: (cpu_seconds(pid) - before[label]) / wall for label, pid in pids.items()
            }
            results[run.name] = summary
            say(
                f"  {run.name}: {summary['throughput_tok_s']:.1f} tok/s, P99 ITL "
                f"{summary['itl_p99'] * 1e3:.0f} ms, cores "
                + ", ".join(f"{k} {v:.2f}" for k, v in summary["cores"].items())
            )
        return results
    finally:
        server.close()


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _cores_cell(cores: dict[str, float]) -> str:
    nodes = {k: v for k, v in cores.items() if k != "router"}
    text = ", ".join(f"{k.split('-')[0]} {v:.2f}" for k, v in nodes.items())
    return f"{text} (router {cores.get('router', 0.0):.2f})"


def _ratio(run: dict, base: dict, key: str) -> str:
    return f"{run[key] / base[key]:.2f}x" if base[key] else "n/a"


def workload_table(name: str, by_layout: dict[str, dict[str, dict]]) -> str:
    rows = []
    for layout, results in by_layout.items():
        s = results[name]
        rows.append([
            layout,
            f"{s['completed']}/{s['requests']}",
            f"**{s['throughput_tok_s']:.1f}**",
            f"{s['ttft_p50']:.2f} / {s['ttft_p99']:.2f}",
            f"{s['tpot_p50'] * 1e3:.0f}",
            f"{s['itl_p50'] * 1e3:.0f} / {s['itl_p99'] * 1e3:.0f}",
            _cores_cell(s["cores"]),
        ])
    header = [
        "layout", "done", "output tok/s", "TTFT P50 / P99 (s)", "TPOT P50 (ms)",
        "ITL P50 / P99 (ms)", "cores used",
    ]
    first, *others = [layout for layout in by_layout if layout.startswith("1P1D")]
    base = by_layout[first][name]
    ratios = [
        f"- {layout} / {first}: output tok/s {_ratio(s, base, 'throughput_tok_s')}, TTFT P50 "
        f"{_ratio(s, base, 'ttft_p50')}, ITL P50 {_ratio(s, base, 'itl_p50')}, ITL P99 "
        f"{_ratio(s, base, 'itl_p99')}"
        for layout in others
        for s in [by_layout[layout][name]]
    ]
    ratio = "Ratios (tok/s: higher is better; latencies: lower is better):\n\n" + "\n".join(ratios)
    return f"### {name}\n\n" + md_table(header, rows) + f"\n\n{ratio}\n"


def serve_dtype() -> str:
    """The dtype `pdserve serve` runs in on this CPU (its `--dtype auto`), and why."""
    import torch

    from pdserve.engine.config import EngineConfig

    return str(EngineConfig(model=None).resolve_dtype(torch.device("cpu"), None))


def setup_paragraph(args: argparse.Namespace) -> str:
    return (
        "Model: SmolLM2-135M-Instruct (the default model) unless `--model` says otherwise, in "
        f"`pdserve serve`'s default dtype ({serve_dtype()}); one `pdserve serve` per layout, "
        "warmed with 2 short "
        "requests; random token ids, greedy, EOS ignored. Closed-loop runs send "
        f"{args.waves} x concurrency requests (at least 4) through that many slots; the mix "
        f"sends {args.mix_requests} requests at Poisson arrivals. Cores used = the process's "
        "CPU seconds (all threads) / the run's wall time; the router's share is in "
        "parentheses. ITL is the gap between streamed chunks.\n"
    )


def build_report(args: argparse.Namespace, machine: dict, by_layout: dict, names: list[str]):
    machine = {**machine, "load average at end": load_average()}
    parts = [
        "# Threads per node: disjoint shares vs every node on all the cores\n",
        f"Command: `{command_line()}`\n",
        md_table(["machine", ""], [[k, v] for k, v in machine.items()]),
        "",
        setup_paragraph(args),
    ]
    parts += [workload_table(name, by_layout) for name in names]
    return "\n".join(parts).rstrip() + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.thread_layout")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,16,64", help="closed-loop concurrencies")
    parser.add_argument("--waves", type=int, default=2, help="requests per slot, closed loop")
    parser.add_argument("--mix-rates", default="0.4", help="requests/s of the long-prompt mix")
    parser.add_argument("--mix-requests", type=int, default=16)
    parser.add_argument("--long-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a one-minute smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.waves, args.output_len = "1,4", 1, 8
        args.mix_rates, args.mix_requests = "1", 2
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.mix_rates = [float(r) for r in args.mix_rates.split(",") if r]
    if args.output is None and not args.quick:
        args.output = RESULTS / "thread_layout.md"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_info()
    vocab = load_vocabulary(args.model, None).ids
    runs = workloads(args, vocab)
    by_layout = {}
    for layout, flags in layouts(usable_cores()).items():
        say(f"{layout}: pdserve serve {' '.join(flags)}")
        by_layout[layout] = run_layout(flags, runs, vocab, args.model)
    text = build_report(args, machine, by_layout, [run.name for run in runs])
    print(text)
    if args.output is not None:
        args.output.write_text(text, encoding="utf-8")
        say(f"wrote {args.output}")


if __name__ == "__main__":
    main()
