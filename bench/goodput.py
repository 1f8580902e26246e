"""Goodput of each layout on one mixed, bursty workload: colocated, 1P1D with every prompt
disaggregated (`--disagg-policy always`) and 1P1D with conditional disaggregation (`auto`).

    python -m pdserve.bench.goodput [--quick] [--model DIR] [--out-dir DIR]

The same host for every layout (each `pdserve serve` splits this machine's cores among its
nodes), the same requests in the same order at the same times. The workload, per load: chat
turns (one of four shared 120-token system prompts plus a 16-64-token user turn, 48 output
tokens) and, at `--long-fraction`, long documents (1,200-1,600 tokens, 16 output tokens);
random token ids, greedy, EOS ignored. Loads: one stream (each request after the previous
one), then gamma arrivals (shape `--burstiness`, bursty below 1) at each of `--rates`.
Goodput: requests per second that met both SLOs (TTFT and TPOT). Writes goodput.md and
goodput.json (bench/results/ unless `--out-dir`), with the machine and how many prompts auto
computed on each side (/metrics).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.disagg_vs_colocated import vocabulary
from pdserve.bench.machine import command_line, load_average, machine_info
from pdserve.bench.report import md_table
from pdserve.bench.serve_arrivals import arrival_times
from pdserve.bench.serve_load import LoadOptions, LoadRequest, run_load, summarize
from pdserve.commands.serve_process import ServeProcess

RESULTS = Path(__file__).parent / "results"
LAYOUTS = {
    "colocated": ["--colocated"],
    "1p1d always": ["--prefill", "1", "--decode", "1", "--disagg-policy", "always"],
    "1p1d auto": ["--prefill", "1", "--decode", "1", "--disagg-policy", "auto"],
}
SYSTEM_PROMPTS, SYSTEM_TOKENS = 4, 120


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.goodput")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--rates", default="0.5,1.5", help="requests/s of the bursty loads")
    parser.add_argument("--requests", type=int, default=24, help="per bursty load")
    parser.add_argument("--single-stream-requests", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="runs of each load per layout; the one of median goodput is reported",
    )
    parser.add_argument("--long-fraction", type=float, default=0.2)
    parser.add_argument("--burstiness", type=float, default=0.5, help="gamma shape")
    parser.add_argument("--slo-ttft", type=float, default=4.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="one small load, nothing written")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.quick:
        args.rates, args.requests, args.single_stream_requests = [1.0], 6, 2
        args.repeats = 1
    return args


def workload(vocab: list[int], times: list[float], args, seed: str) -> list:
    """One request per send time in `times`."""
    rng = random.Random(f"{args.seed}-{seed}")
    systems = [
        [rng.choice(vocab) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEM_PROMPTS)
    ]
    requests = []
    for at in times:
        if rng.random() < args.long_fraction:
            prompt = [rng.choice(vocab) for _ in range(rng.randint(1200, 1600))]
            requests.append(LoadRequest(at, prompt, 16, "document"))
        else:
            turn = [rng.choice(vocab) for _ in range(rng.randint(16, 64))]
            requests.append(LoadRequest(at, rng.choice(systems) + turn, 48, "chat"))
    return requests


def loads(vocab: list[int], args) -> dict[str, tuple[list[list[LoadRequest]], int | None]]:
    """Load name -> (the requests of each repeat, max concurrency). Each repeat has prompts of
    its own (system prompts included), so no repeat finds an earlier one's in a prefix cache;
    the arrival times are the load's."""
    out: dict[str, tuple[list[list[LoadRequest]], int | None]] = {}
    single_times = [0.0] * args.single_stream_requests
    out["1 stream"] = (
        [workload(vocab, single_times, args, f"single-{k}") for k in range(args.repeats)], 1
    )
    for rate in args.rates:
        times = arrival_times(args.requests, rate, "gamma", args.burstiness, args.seed)
        out[f"{rate} requests/s"] = (
            [workload(vocab, times, args, f"{rate}-{k}") for k in range(args.repeats)], None
        )
    return out


def placements(url: str) -> dict[str, float]:
    """Prompts computed on each side so far ("local", "remote"), whatever the reason."""
    totals: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_prefill_placements_total":
                side = sample.labels["placement"]
                totals[side] = totals.get(side, 0.0) + sample.value
    return totals


def run_once(url: str, requests: list[LoadRequest], concurrency: int | None, args) -> dict:
    """One pass of a load: its summary, with the placements it caused."""
    before = placements(url)
    timings, wall = run_load(url, requests, LoadOptions(max_concurrency=concurrency))
    summary = summarize(timings, wall, args.slo_ttft, args.slo_tpot)
    after = placements(url)
    summary["placements"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return summary


def run_layout(flags: list[str], workloads: dict, args) -> dict:
    model_flags = ["--model", args.model] if args.model else []
    server = ServeProcess([*model_flags, *flags], quiet=True, ready_timeout_s=300)
    try:
        warm_up = [LoadRequest(0.0, list(range(100, 164)), 8, "warm-up")]
        run_load(server.url, warm_up)
        results = {}
        for name, (repeats, concurrency) in workloads.items():
            runs = [run_once(server.url, requests, concurrency, args) for requests in repeats]
            summary = sorted(runs, key=lambda r: r["goodput"])[len(runs) // 2]
            summary["goodput_runs"] = [r["goodput"] for r in runs]
            results[name] = summary
            print(f"[{time.strftime('%H:%M:%S')}] {flags}: {name}: goodput "
                  + ", ".join(f"{g:.3f}" for g in summary["goodput_runs"]) + "/s", flush=True)
        return results
    finally:
        server.close()


def report(args, machine: dict, results: dict[str, dict[str, dict]]) -> str:
    sections = [
        "# Goodput by layout: colocated, 1P1D, 1P1D with conditional disaggregation",
        f"Command: `{command_line()}`",
        md_table(["machine", ""], [[k, v] for k, v in machine.items()]),
        (
            f"Model: {args.model or 'SmolLM2-135M-Instruct (the default model)'}. Every layout "
            "is `pdserve serve` on this whole host (its default thread layout). Workload: chat "
            f"turns ({SYSTEM_PROMPTS} shared {SYSTEM_TOKENS}-token system prompts + 16-64 "
            f"tokens, 48 output tokens) and {args.long_fraction:.0%} long documents "
            "(1,200-1,600 tokens, 16 output tokens); random token ids, greedy, EOS ignored; the "
            f"same requests at the same times for every layout. Loads: 1 stream "
            f"({args.single_stream_requests} requests one after another), then "
            f"{args.requests} requests per rate with gamma arrivals (shape {args.burstiness}). "
            f"Each load runs {args.repeats} times per layout, one after another on the same "
            "server, each time with prompts of its own (no prefix-cache hits across runs): the "
            "run of median goodput is shown, every run's goodput in the last column. "
            f"SLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s. Placements: prompts "
            "auto computed on the decode node (local) or on the prefill node (remote)."
        ),
    ]
    layouts = list(results)
    for load in next(iter(results.values())):
        rows = []
        for layout in layouts:
            r = results[layout][load]
            placed = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["placements"].items())) or "-"
            rows.append([
                layout, f"{r['completed']}/{r['requests']}", f"{r['goodput']:.3f}",
                f"{r['slo_attainment']:.2f}", f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f}",
                f"{r['itl_p50'] * 1e3:.0f} / {r['itl_p99'] * 1e3:.0f}",
                f"{r['throughput_tok_s']:.1f}", placed,
                ", ".join(f"{g:.3f}" for g in r["goodput_runs"]),
            ])
        sections += [f"## {load}", md_table(
            ["layout", "completed", "goodput (req/s)", "SLO met", "TTFT P50 / P99 (s)",
             "ITL P50 / P99 (ms)", "output tok/s", "placements", "goodput of each run"], rows,
        )]
    sections += [
        "## Goal: auto >= the best fixed layout at every load", "\n".join(goal_lines(results))
    ]
    sections.append(f"Load average at end: {load_average()}.")
    return "\n\n".join(sections) + "\n"


def goal_lines(results: dict[str, dict[str, dict]]) -> list[str]:
    lines = []
    for load, auto in results["1p1d auto"].items():
        best_name = max(("colocated", "1p1d always"), key=lambda n: results[n][load]["goodput"])
        best = results[best_name][load]["goodput"]
        ratio = auto["goodput"] / best if best else float("inf")
        verdict = "met" if auto["goodput"] >= best else "not met"
        lines.append(f"- {load}: auto {auto['goodput']:.3f} vs best fixed ({best_name}) "
                     f"{best:.3f} requests/s: {ratio:.2f}x, {verdict}")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_info()
    workloads = loads(vocabulary(args.model), args)
    results = {name: run_layout(flags, workloads, args) for name, flags in LAYOUTS.items()}
    text = report(args, machine, results)
    print(text)
    if not args.quick:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "goodput.md").write_text(text)
        (args.out_dir / "goodput.json").write_text(json.dumps(
            {"machine": machine, "results": results}, indent=1, default=str
        ))


if __name__ == "__main__":
    main()
