"""Command-line flags shared by `pdserve.bench.serve` and `pdserve.bench.sweep`: the dataset, the
token
vocabulary and the arrival process, and how they become a list of timed requests."""

from __future__ import annotations

import argparse
import math

from pdserve.bench.serve_arrivals import arrival_times
from pdserve.bench.serve_datasets import (
    DATASETS,
    ChatSpec,
    RandomSpec,
    SharedPrefixSpec,
    TraceSpec,
    chat_requests,
    random_requests,
    shared_prefix_requests,
    trace_requests,
)
from pdserve.bench.serve_load import LoadRequest


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", default="random", choices=DATASETS)
    group.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="measured requests (default: 100; shared-prefix: groups x prompts per group; "
        "trace: every line)",
    )
    group.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    group.add_argument(
        "--output-len", type=int, default=128, help="random, shared-prefix: output tokens"
    )
    group.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len x (1 - r), len x (1 + r)], 0 <= r < 1",
    )
    group.add_argument("--groups", type=int, default=8, help="shared-prefix: prefixes")
    group.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix")
    group.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens")
    group.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: tokens")
    chat = ChatSpec()
    for side in ("input", "output"):
        group.add_argument(
            f"--chat-{side}-median",
            type=float,
            default=getattr(chat, f"{side}_median"),
            help=f"chat: median {side} tokens (lognormal)",
        )
        group.add_argument(
            f"--chat-{side}-sigma",
            type=float,
            default=getattr(chat, f"{side}_sigma"),
            help=f"chat: sigma of log({side} tokens)",
        )
        group.add_argument(
            f"--chat-{side}-max",
            type=int,
            default=getattr(chat, f"{side}_max"),
            help=f"chat: {side} lengths are clipped to this",
        )
    group.add_argument("--chat-min-len", type=int, default=chat.min_len, help="chat: floor")
    group.add_argument("--trace", default=None, help="trace: a Mooncake-format JSONL file")
    group.add_argument(
        "--trace-block-size", type=int, default=512, help="trace: tokens per hash id"
    )
    group.add_argument(
        "--trace-speedup", type=float, default=1.0, help="trace: replay this many times faster"
    )
    group.add_argument("--seed", type=int, default=0)
    vocab = parser.add_argument_group("token vocabulary")
    vocab.add_argument(
        "--tokenizer", default=None, help="model folder whose tokenizer supplies the token ids"
    )
    vocab.add_argument(
        "--vocab-size", type=int, default=None, help="draw ids from this vocabulary size instead"
    )


def add_arrival_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("arrivals")
    group.add_argument(
        "--arrival",
        default="poisson",
        choices=("poisson", "gamma"),
        help="inter-arrival distribution (gamma: shape --burstiness)",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape: 1.0 = Poisson, < 1 burstier, > 1 more regular",
    )


def dataset_requests(
    args: argparse.Namespace, vocab: list[int], seed: int | str | None = None
) -> list[LoadRequest]:
    """The dataset's requests (trace requests carry their send times; the others are at 0)."""
    seed = args.seed if seed is None else seed
    count = args.num_prompts
    if count is not None and count < 1:
        raise ValueError(f"--num-prompts is {count}; expected at least 1")
    if args.dataset == "random":
        spec = RandomSpec(args.input_len, args.output_len, args.range_ratio)
        return random_requests(spec, count or 100, vocab, seed)
    if args.dataset == "shared-prefix":
        spec = SharedPrefixSpec(
            args.groups, args.prompts_per_group, args.prefix_len, args.suffix_len, args.output_len
        )
        return shared_prefix_requests(spec, vocab, seed)[:count]
    if args.dataset == "chat":
        spec = ChatSpec(
            args.chat_input_median,
            args.chat_input_sigma,
            args.chat_input_max,
            args.chat_output_median,
            args.chat_output_sigma,
            args.chat_output_max,
            args.chat_min_len,
        )
        return chat_requests(spec, count or 100, vocab, seed)
    if not args.trace:
        raise ValueError("--dataset trace needs --trace FILE.jsonl")
    spec = TraceSpec(args.trace, args.trace_block_size, args.trace_speedup)
    return trace_requests(spec, vocab, count, seed)


def timed_requests(
    args: argparse.Namespace, vocab: list[int], rate: float, seed: int | str | None = None
) -> list[LoadRequest]:
    """The dataset's requests with send times: a trace's own timestamps, else arrivals at
    `rate` requests/s (inf: all at once)."""
    requests = dataset_requests(args, vocab, seed)
    if args.dataset == "trace":
        if not math.isinf(rate):
            raise ValueError("--dataset trace sends at its timestamps; drop --request-rate")
        return requests
    seed = args.seed if seed is None else seed
    times = arrival_times(len(requests), rate, args.arrival, args.burstiness, seed)
    for request, at in zip(requests, times):
        request.at = at
    return requests


def describe_dataset(args: argparse.Namespace) -> str:
    details = {
        "random": f"input {args.input_len} tokens, output {args.output_len}, range ratio "
        f"{args.range_ratio:g}",
        "shared-prefix": f"{args.groups} groups x {args.prompts_per_group} prompts, prefix "
        f"{args.prefix_len} tokens + suffix {args.suffix_len}, output {args.output_len}",
        "chat": f"input lognormal(median {args.chat_input_median:g}, sigma "
        f"{args.chat_input_sigma:g}) in [{args.chat_min_len}, {args.chat_input_max}], output "
        f"lognormal(median {args.chat_output_median:g}, sigma {args.chat_output_sigma:g}) in "
        f"[{args.chat_min_len}, {args.chat_output_max}]",
        "trace": f"{args.trace}, {args.trace_block_size} tokens per hash id, "
        f"{args.trace_speedup:g}x speed",
    }
    return f"{args.dataset}: {details[args.dataset]}"
