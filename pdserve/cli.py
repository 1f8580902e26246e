"""The `pdserve` command.

  pdserve download            fetch and convert the default model (idempotent)
  pdserve generate PROMPT...  one-shot greedy generation, printed as it streams
  pdserve chat                interactive chat with the model's chat template
  pdserve serve               the OpenAI-compatible HTTP server (router + colocated node)
  pdserve bench serve         load-test an OpenAI-compatible server (python -m bench.serve)
  pdserve colocated|prefill|decode [flags]
                              one node that joins a router elsewhere (python -m <role>_node)

Node code is imported inside each subcommand, so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

NODE_ROLES = ("colocated", "prefill", "decode")

def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    _device_args(parser)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    _prefix_cache_args(parser, default_min_blocks=2)


def _device_args(parser: argparse.ArgumentParser) -> None:
    """How a node uses its device (EngineConfig's attention_backend, cuda_graphs and
    gpu_memory_utilization); None leaves the engine's default."""
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="auto (default: triton on CUDA, torch on the CPU), torch or triton",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (default: decode steps replay them on CUDA with triton attention)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="fraction of each GPU's memory that the node processes on it hold together, in "
        "equal shares (default 0.9)",
    )


def _check_device_args(args: argparse.Namespace) -> None:
    utilization = args.gpu_memory_utilization
    if utilization is not None and not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization:g}")


def _scheduling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preemption-mode",
        choices=("auto", "recompute", "swap"),
        default=None,
        help="cure for preempted requests (default auto: the cheaper by measured cost)",
    )
    parser.add_argument(
        "--swap-space", type=float, default=None, metavar="GIB",
        help="host memory per node for swapped-out KV (default 4 GiB; 0 disables swapping)",
    )
    parser.add_argument(
        "--admission",
        choices=("optimistic", "worst-case", "predicted"),
        default=None,
        help="KV reserved at admission (default optimistic: the next chunk only)",
    )
    parser.add_argument(
        "--admission-quantile", type=float, default=None,
        help="quantile of observed output lengths reserved by predicted admission (0.9)",
    )
    parser.add_argument(
        "--priority-aging-seconds", dest="priority_aging_s", type=float, default=None,
        help="seconds of waiting worth one priority level (default 10; 0: strict)",
    )


def _prefix_cache_args(parser: argparse.ArgumentParser, default_min_blocks: int | None) -> None:
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt prefixes seen before (default: on)",
    )
    parser.add_argument(
        "--prefix-cache-min-blocks",
        type=int,
        default=default_min_blocks,
        help="shortest run of full KV blocks the prefix cache keeps (default: 2)",
    )


def _failure_args(parser: argparse.ArgumentParser) -> None:
    """Deadlines of failure handling (docs/failure-handling.md)."""
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="how often each node tells the router it is alive (default 0.5)",
    )
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a node is dead after this long without a heartbeat (default: 2 intervals)",
    )
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a KV transfer's deadline, from its first block's write, and the deadline of "
        "the first token after the KV arrived (default 30)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="how long a request may wait on a decode node for free KV blocks, and then for "
        "its prefill node to start on it (default 120; the router's --max-queue-delay "
        "refuses work long before)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, how long requests in flight may still run (default 30)",
    )
    parser.add_argument(
        "--restart-nodes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a node process that exits (default: on)",
    )


def _router_limit_args(parser: argparse.ArgumentParser) -> None:
    """The router's queue and stream bounds (defaults: the router's own)."""
    parser.add_argument(
        "--max-queued-requests",
        "--max-waiting-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests admitted and not started yet before new ones get 429 (default 1024)",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens of those requests before new ones get 429 (default 1048576)",
    )
    parser.add_argument(
        "--max-queue-delay",
        type=float,
        default=None,
        metavar="S",
        help="a request that would wait longer than this for its prefill (queued prompt "
        "tokens / measured prefill speed, or the age of the oldest request still waiting) "
        "gets 429 at once (default 30)",
    )
    parser.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a stream whose client reads nothing for this long is aborted (default 30)",
    )
    parser.add_argument(
        "--max-stream-buffer-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens held for a client that reads slower than the model writes; past it "
        "the request is aborted (default 8192)",
    )


def _make_llm(args: argparse.Namespace):
    from engine import LLM

    device_options = {"cuda_graphs": False} if args.enforce_eager else {}
    if args.attention_backend is not None:
        device_options["attention_backend"] = args.attention_backend
    if args.gpu_memory_utilization is not None:
        device_options["gpu_memory_utilization"] = args.gpu_memory_utilization
    return LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_min_blocks=args.prefix_cache_min_blocks,
        **device_options,
    )


def _params(args: argparse.Namespace):
    from engine import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)


def _print_stream(pieces) -> str:
    """Prints text pieces as they arrive, then a newline; returns the whole text."""
    text = []
    for piece in pieces:
        text.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(text)


def cmd_download(args: argparse.Namespace) -> int:
    from model_store.default_model import ensure_default_model

    print(ensure_default_model())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    _print_stream(llm.stream(" ".join(args.prompt), _params(args)))
    return 0


def _chat_turn(llm, history: list[dict], params) -> str:
    return _print_stream(llm.stream(llm.tokenizer.apply_chat_template(history), params))


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _params(args)
    history: list[dict] = []
    print("pdserve chat: type a message, or an empty line to quit.", file=sys.stderr)
    while True:
        try:
            message = input("> ").strip()
        except EOFError:
            return 0
        if not message:
            return 0
        history.append({"role": "user", "content": message})
        history.append({"role": "assistant", "content": _chat_turn(llm, history, params)})


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.launcher import check_cluster_settings, serve

    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode need at least one node each")
    for name in ("heartbeat_interval", "transfer_timeout", "queue_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.node_timeout is not None and args.node_timeout <= args.heartbeat_interval:
        raise ValueError(
            f"--node-timeout {args.node_timeout:g} must exceed --heartbeat-interval "
            f"{args.heartbeat_interval:g}"
        )
    if args.drain_timeout < 0:
        raise ValueError("--drain-timeout must be 0 or more")
    _check_device_args(args)
    check_cluster_settings(args)
    return serve(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.plan import parse_bytes, plan_capacity, render_json, render_table, resolve_shape

    plan = plan_capacity(
        resolve_shape(args.model),
        args.dtype,
        parse_bytes(args.memory),
        args.reserve,
        [int(n) for n in args.seq_lens.split(",")],
        args.block_size,
    )
    print(render_json(plan) if args.json else render_table(plan))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if not args.bench_args or args.bench_args[0] != "serve":
        print("pdserve bench: expected `pdserve bench serve [flags]`", file=sys.stderr)
        return 2
    from bench.serve import main as serve_main

    return serve_main(args.bench_args[1:], prog="pdserve bench serve")


def cmd_node(role: str, node_args: list[str]) -> int:
    """One node of `role` that joins a router elsewhere (`python -m {role}_node` flags)."""
    if role == "prefill":
        from prefill_node.__main__ import main
    elif role == "decode":
        from decode_node.__main__ import main
    else:
        from colocated_node.__main__ import main
    return main(node_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("download", help="fetch and convert the default model").set_defaults(
        run=cmd_download
    )
    generate = sub.add_parser("generate", help="one-shot generation")
    generate.add_argument("prompt", nargs="+")
    _engine_args(generate)
    generate.set_defaults(run=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat")
    _engine_args(chat)
    chat.set_defaults(run=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--colocated", action="store_true", help="prefill and decode in one node")
    serve.add_argument("--prefill", type=int, default=1, help="prefill nodes (default 1)")
    serve.add_argument("--decode", type=int, default=1, help="decode nodes (default 1)")
    serve.add_argument("--threads-per-node", type=int, default=None, help="CPU threads each")
    serve.add_argument(
        "--router-listen", default=None, help="the router's ZeroMQ address for node messages"
    )
    serve.add_argument(
        "--kv-transport",
        default="auto",
        choices=("auto", "shm", "zmq", "cuda_ipc"),
        help="how KV moves from prefill to decode nodes (auto: cuda_ipc on GPUs, else shm)",
    )
    serve.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    serve.add_argument(
        "--load-format",
        default=None,
        choices=("auto", "dummy"),
        help="auto (default: the folder's *.safetensors) or dummy (random weights from "
        "config.json; the router still needs the folder's tokenizer)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=None)
    serve.add_argument("--max-num-batched-tokens", type=int, default=None)
    serve.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    _device_args(serve)
    _prefix_cache_args(serve, default_min_blocks=None)
    _scheduling_args(serve)
    serve.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    serve.add_argument(
        "--cluster-secret",
        default=os.environ.get("PDSERVE_CLUSTER_SECRET") or None,
        metavar="SECRET",
        help="secures the ZeroMQ links between router and nodes (default: "
        "$PDSERVE_CLUSTER_SECRET, else a random one for this run's own processes)",
    )
    _failure_args(serve)
    _router_limit_args(serve)
    serve.set_defaults(run=cmd_serve)
    plan = sub.add_parser("plan", help="KV cache size and maximum concurrency for a model")
    plan.add_argument("--model", required=True, help="a model folder or a known name")
    plan.add_argument("--dtype", default="bf16", help="KV and weight dtype (default bf16)")
    plan.add_argument("--memory", default="80GiB", help="device memory, e.g. 80GiB")
    plan.add_argument("--reserve", type=float, default=0.1, help="fraction kept free")
    plan.add_argument("--seq-lens", default="1024,8192,32768", help="tokens per sequence")
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(run=cmd_plan)
    sub.add_parser(
        "bench", help="serve: load-test any OpenAI-compatible server", add_help=False
    ).add_argument("bench_args", nargs=argparse.REMAINDER)
    for role in NODE_ROLES:
        sub.add_parser(
            role,
            help=f"one {role} node that joins a router elsewhere (python -m {role}_node flags)",
            add_help=False,
        ).add_argument("node_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # every later flag belongs to the benchmark
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    if argv and argv[0] in NODE_ROLES:  # every later flag belongs to the node
        return cmd_node(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"pdserve: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
