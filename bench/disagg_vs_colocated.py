"""Disaggregated vs colocated serving on equal hardware, through the same HTTP API.

    python -m pdserve.bench.disagg_vs_colocated [--quick]

On this 2-core CPU: 1 prefill node + 1 decode node with one thread each, against one colocated
node with two threads (the CPU-host analogue of 1 GPU each vs 2 GPUs of colocated replicas is
not available here). Poisson arrivals mixing long prompts (~1,500 tokens, 16-token outputs)
with chat-like requests (50-150-token prompts, 200-token outputs), the same requests for both
modes at each rate. Prints TTFT, TPOT and ITL at P50/P90/P99, throughput and goodput under a
TTFT + TPOT SLO, with the ratios; writes bench/results/disagg_vs_colocated.md and .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

from pdserve.bench.disagg_report import build_report, plot
from pdserve.bench.machine import machine_info
from pdserve.bench.serve_load import LoadRequest, run_load, summarize
from pdserve.commands.serve_process import ServeProcess

RESULTS = Path(__file__).parent / "results"
MODES = {
    "colocated": ["--colocated", "--threads-per-node", "2"],
    "disaggregated": ["--prefill", "1", "--decode", "1", "--threads-per-node", "1"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.disagg_vs_colocated")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--rates", default="0.2,0.4,0.8", help="requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=16, help="per rate")
    parser.add_argument("--long-fraction", type=float, default=0.3)
    parser.add_argument("--slo-ttft", type=float, default=10.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.25, help="seconds per token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.quick:
        args.rates, args.requests = [0.3], 4
    return args


def make_requests(vocab: list[int], count: int, rate: float, args) -> list[LoadRequest]:
    rng = random.Random(f"{args.seed}-{rate}")
    requests, at = [], 0.0
    for _ in range(count):
        if rng.random() < args.long_fraction:
            length, output, kind = rng.randint(1400, 1600), 16, "long"
        else:
            length, output, kind = rng.randint(50, 150), 200, "chat"
        requests.append(LoadRequest(at, [rng.choice(vocab) for _ in range(length)], output, kind))
        at += rng.expovariate(rate)
    return requests


def vocabulary(model: str | None) -> list[int]:
    from pdserve.model_store.default_model import ensure_default_model
    from pdserve.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(model) if model else ensure_default_model())
    special = tokenizer.added_token_ids
    return [t for t in range(len(tokenizer)) if t not in special]


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # the plot is the run's last step
        raise SystemExit(
            "python -m pdserve.bench.disagg_vs_colocated: needs matplotlib for its plot: "
            "pip install 'pdserve[bench]'"
        )
    machine = machine_info()
    vocab = vocabulary(args.model)
    results: dict[str, dict[float, dict]] = {}
    for mode, flags in MODES.items():
        model_flags = ["--model", args.model] if args.model else []
        server = ServeProcess([*model_flags, *flags], quiet=True)
        try:
            warm = [LoadRequest(0.0, vocab[:64], 8, "warm-up")]
            run_load(server.url, warm)
            results[mode] = {}
            for rate in args.rates:
                timings, wall = run_load(
                    server.url, make_requests(vocab, args.requests, rate, args)
                )
                results[mode][rate] = summarize(timings, wall, args.slo_ttft, args.slo_tpot)
                summary = results[mode][rate]
                say(
                    f"{mode} at {rate}/s: P99 ITL {summary['itl_p99']:.3f} s, "
                    f"goodput {summary['goodput']:.3f}/s"
                )
        finally:
            server.close()
    text = build_report(args, machine, results)
    print(text)
    if not args.quick:
        (RESULTS / "disagg_vs_colocated.md").write_text(text)
        plot(results, args, RESULTS / "disagg_vs_colocated.png")
        say("wrote bench/results/disagg_vs_colocated.md and .png")


if __name__ == "__main__":
    main()
