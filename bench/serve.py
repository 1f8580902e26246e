"""Serving benchmark against any OpenAI-compatible server (pdserve, vLLM, SGLang).

    python -m pdserve.bench.serve --base-url http://127.0.0.1:8000 --dataset random \\
        --input-len 256 --output-len 64 --num-prompts 50 --request-rate 2 \\
        --slo ttft:2000,tpot:100 --result-json out.json
    pdserve bench serve ...      (the same flags)

Prompts are token-id lists (see bench/serve_datasets.py) streamed from /v1/completions, or sent
as text to /v1/chat/completions with `--endpoint chat`; arrivals are Poisson or Gamma at
`--request-rate` (inf: all at once), a trace's own timestamps for `--dataset trace`. `--warmup`
requests go first and are not counted. Prints a markdown report with the command and the
machine; `--result-json` and `--result-md` keep it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from pdserve.bench.serve_datasets import warmup_requests
from pdserve.bench.serve_load import LoadOptions, discover_model, run_load, summarize
from pdserve.bench.serve_metrics import parse_slo
from pdserve.bench.serve_options import (
    add_arrival_args,
    add_dataset_args,
    describe_dataset,
    timed_requests,
)
from pdserve.bench.serve_report import markdown, record
from pdserve.bench.serve_vocab import load_vocabulary


def build_parser(prog: str = "python -m pdserve.bench.serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Serving benchmark against any OpenAI-compatible server."
    )
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000")
    server.add_argument("--model", default=None, help="default: the first id at /v1/models")
    server.add_argument("--endpoint", default="completions", choices=("completions", "chat"))
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)"
    )
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first")
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the asked-for tokens (default: on)",
    )
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    add_arrival_args(parser)
    add_dataset_args(parser)
    out = parser.add_argument_group("results")
    out.add_argument("--slo", default=None, help="ttft:MS,tpot:MS (either part optional)")
    out.add_argument("--result-json", default=None, help="write the result as JSON here")
    out.add_argument("--result-md", default=None, help="write the markdown report here")
    out.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar"
    )
    return parser


def _setup(args: argparse.Namespace, model: str, vocab_source: str, count: int) -> dict:
    arrivals = (
        "trace timestamps"
        if args.dataset == "trace"
        else f"{args.request_rate:g} req/s, {args.arrival} (burstiness {args.burstiness:g})"
    )
    return {
        "server": args.base_url,
        "model": model,
        "endpoint": f"/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}",
        "dataset": describe_dataset(args),
        "token ids": vocab_source,
        "requests": f"{count} measured + {args.warmup} warm-up, seed {args.seed}",
        "arrivals": arrivals,
        "max concurrency": args.max_concurrency or "unlimited",
        "ignore_eos": args.ignore_eos,
        "SLO": parse_slo(args.slo).describe(),
    }


def run(args: argparse.Namespace, command: str) -> dict:
    """Runs the benchmark the flags describe; returns the JSON record."""
    from tqdm import tqdm

    from pdserve.bench.machine import machine_info

    slo = parse_slo(args.slo)
    if args.warmup < 0:
        raise ValueError(f"--warmup is {args.warmup}; expected 0 or more")
    vocab = load_vocabulary(args.tokenizer, args.vocab_size)
    requests = timed_requests(args, vocab.ids, args.request_rate)
    model = args.model or discover_model(args.base_url, args.api_key)
    options = LoadOptions(
        model=model,
        endpoint=args.endpoint,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        timeout_s=args.timeout,
        to_text=vocab.text if args.endpoint == "chat" else None,
    )
    machine = machine_info()
    if args.warmup:
        run_load(args.base_url, warmup_requests(args.warmup, vocab.ids, args.seed), options)
    bar = tqdm(total=len(requests), desc="requests", file=sys.stderr, disable=not args.progress)
    with bar:
        counted = dataclasses.replace(options, on_done=lambda _timing: bar.update())
        timings, wall = run_load(args.base_url, requests, counted)
    metrics = summarize(timings, wall, slo.ttft_s, slo.tpot_s)
    setup = _setup(args, model, vocab.source, len(requests))
    return record(command, machine, setup, metrics, timings)


def main(argv: list[str] | None = None, prog: str = "python -m pdserve.bench.serve") -> int:
    import json
    import shlex

    raw = sys.argv[1:] if argv is None else argv
    args = build_parser(prog).parse_args(raw)
    command = shlex.join([*prog.split(), *raw])
    try:
        result = run(args, command)
    except ValueError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    text = markdown(result)
    print(text)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2) + "\n")
    if args.result_md:
        Path(args.result_md).write_text(text)
    return 0 if result["metrics"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
