"""Request-rate sweep over serving configurations, through the same HTTP API.

    python -m pdserve.bench.sweep [--configs colocated,1p1d,2p1d,1p1d-no-prefix-cache]
                          [--rates 0.5,1,2,3] [dataset flags of bench.serve] [--quick]

Each configuration is one `pdserve serve` (started and stopped here) with the flags below; at
each rate every configuration gets the same requests (the dataset seeded by seed and rate,
so no rate finds another rate's prefixes in the cache) after the same warm-up. Writes
sweep.md (a table per rate: goodput, TTFT/TPOT/ITL at P50 and P99, throughput, ratios against
colocated), sweep.json and sweep.png (goodput and P99 latencies against the rate) to
--out-dir, bench/results by default.

The default workload (shared-prefix: 4 groups x 6 prompts of a 512-token prefix + 64 tokens,
32 tokens out; SLO TTFT <= 3 s, TPOT <= 150 ms) is sized for the default model on a 2-core
CPU: about 10-12 minutes for the four configurations at four rates. Run it on a quiet machine:
a colocated node's two threads slow down many times over when other processes take a core.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import time
from pathlib import Path

from pdserve.bench.serve_datasets import warmup_requests
from pdserve.bench.serve_load import LoadOptions, run_load, summarize
from pdserve.bench.serve_metrics import parse_slo
from pdserve.bench.serve_options import add_arrival_args, add_dataset_args, timed_requests
from pdserve.bench.serve_report import json_safe
from pdserve.bench.serve_vocab import load_vocabulary

CONFIGS = {
    "colocated": ["--colocated"],
    "1p1d": ["--prefill", "1", "--decode", "1"],
    "2p1d": ["--prefill", "2", "--decode", "1"],
    "1p1d-no-prefix-cache": ["--prefill", "1", "--decode", "1", "--no-enable-prefix-caching"],
}
RESULTS = Path(__file__).parent / "results"
QUICK = {
    "configs": "colocated,1p1d",
    "rates": "1",
    "groups": 2,
    "prompts_per_group": 2,
    "prefix_len": 128,
    "suffix_len": 16,
    "output_len": 8,
    "num_prompts": None,
    "warmup": 1,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.sweep", description=__doc__)
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--rates", default="0.5,1,2,3", help="requests/s, comma-separated")
    parser.add_argument("--serve-flags", default="", help="more `pdserve serve` flags for all")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests per server")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--slo", default="ttft:3000,tpot:150", help="ttft:MS,tpot:MS")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where sweep.md/.json/.png go")
    parser.add_argument("--quick", action="store_true", help="a 1-2 minute smoke run")
    add_arrival_args(parser)
    add_dataset_args(parser)
    parser.set_defaults(
        dataset="shared-prefix",
        groups=4,
        prompts_per_group=6,
        prefix_len=512,
        suffix_len=64,
        output_len=32,
    )
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs {unknown or 'is empty'}: choose from {', '.join(CONFIGS)}")
    try:
        args.rates = [float(rate) for rate in args.rates.split(",")]
        args.slo_parsed = parse_slo(args.slo)
    except ValueError as error:
        parser.error(str(error))
    return args


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sweep_config(
    name: str, args: argparse.Namespace, requests_by_rate: dict[float, list], vocab: list[int]
) -> dict[float, dict] | None:
    """One server for `name`, every rate in turn; None when the server did not start."""
    from pdserve.commands.serve_process import ServeProcess

    model_flags = ["--model", args.model] if args.model else []
    flags = [*model_flags, *CONFIGS[name], *shlex.split(args.serve_flags)]
    try:
        server = ServeProcess(flags, quiet=True)
    except RuntimeError as error:
        say(f"{name}: the server did not start ({error})")
        return None
    slo = args.slo_parsed
    options = LoadOptions(max_concurrency=args.max_concurrency)
    try:
        if args.warmup:
            run_load(server.url, warmup_requests(args.warmup, vocab, args.seed), options)
        results = {}
        for rate, requests in requests_by_rate.items():
            timings, wall = run_load(server.url, requests, options)
            results[rate] = summarize(timings, wall, slo.ttft_s, slo.tpot_s)
            summary = results[rate]
            say(
                f"{name} at {rate:g}/s: {summary['completed']}/{summary['requests']} done, "
                f"goodput {summary['goodput']:.3f}/s, P99 TTFT {summary['ttft_p99']:.2f} s, "
                f"P99 ITL {summary['itl_p99'] * 1000:.0f} ms"
            )
        return results
    finally:
        server.close()


def main(argv: list[str] | None = None) -> None:
    from pdserve.bench.machine import machine_info
    from pdserve.bench.sweep_report import build_report, plot

    args = parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # the plot is the run's last step
        raise SystemExit(
            "python -m pdserve.bench.sweep: needs matplotlib for its plot: "
            "pip install 'pdserve[bench]'"
        )
    machine = machine_info()
    try:
        vocab = load_vocabulary(args.tokenizer or args.model, args.vocab_size)
        requests_by_rate = {
            rate: timed_requests(args, vocab.ids, rate, seed=f"{args.seed}-{rate:g}")
            for rate in args.rates
        }
    except ValueError as error:
        raise SystemExit(f"python -m pdserve.bench.sweep: {error}") from None
    results = {}
    for name in args.configs:
        say(f"{name}: pdserve serve {' '.join(CONFIGS[name])} {args.serve_flags}".rstrip())
        results[name] = sweep_config(name, args, requests_by_rate, vocab.ids)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    server_flags = {name: CONFIGS[name] for name in args.configs}
    text = build_report(args, machine, results, requests_by_rate, server_flags)
    print(text)
    (out_dir / "sweep.md").write_text(text)
    record = {"machine": machine, "configs": server_flags}
    record["results"] = {n: r and {str(k): v for k, v in r.items()} for n, r in results.items()}
    (out_dir / "sweep.json").write_text(json.dumps(json_safe(record), indent=2) + "\n")
    plot(args, results, out_dir / "sweep.png")
    say(f"wrote sweep.md, sweep.json and sweep.png to {out_dir}")


if __name__ == "__main__":
    main()
