"""The flags of `pdserve serve` (and the engine flags `pdserve generate` and `pdserve chat` share).

Where a flag means what vLLM's flag of the same name means, it has vLLM's spelling (the table in
docs/operations.md maps each to vLLM's and SGLang's). `check_serve_flags` checks them once,
before the launcher resolves the model or starts any process; a ValueError from it is printed
with `pdserve serve`'s usage.
"""

from __future__ import annotations

import argparse
import os

from router.log_format import LOG_FORMATS, LOG_LEVELS

DTYPES = ("auto", "bfloat16", "float16", "float32")
GENERATION_CONFIG_DEFAULT = "vllm"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
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


def check_device_flags(args: argparse.Namespace) -> None:
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


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    _deployment_flags(serve)
    _model_flags(serve)
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
    _router_log_flags(serve)


# The router's logging flags (router/log_format.py), passed to it as given; None: its default.
ROUTER_LOG_FLAGS = ("log_level", "log_format", "uvicorn_log_level")
ROUTER_LOG_SWITCHES = ("disable_log_requests", "disable_log_stats")


def _router_log_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--log-level", default=None, type=str.lower, choices=LOG_LEVELS,
        help="the router's log level (default info)",
    )
    serve.add_argument(
        "--log-format", default=None, choices=LOG_FORMATS,
        help="the router's log lines: text, or json (one object per line) (default text)",
    )
    serve.add_argument(
        "--uvicorn-log-level", default=None, type=str.lower, choices=LOG_LEVELS,
        help="uvicorn's own loggers in the router (default warning)",
    )
    serve.add_argument(
        "--disable-log-requests", action="store_true", help="no access line per request"
    )
    serve.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic stats line per node"
    )


def _deployment_flags(serve: argparse.ArgumentParser) -> None:
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
    serve.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="1 only: pdserve runs each node on one device (scale with --prefill/--decode)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--verbose",
        action="store_true",
        help="every process writes to this terminal from the start (default: each to its "
        "log file, echoed here once the deployment is ready)",
    )


def _model_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "model_arg",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a model folder or a Hugging Face Hub id (org/name); default: SmolLM2-135M-Instruct",
    )
    serve.add_argument("--model", default=None, help="MODEL, as a flag")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients may send as `model`; /v1/models lists the first (default: the "
        "folder's name, or the Hub id)",
    )
    serve.add_argument(
        "--revision", default=None, help="a Hub id's branch, tag or commit (default: main)"
    )
    serve.add_argument(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="the Hugging Face cache a Hub id is read from and fetched into (default: "
        "$HF_HUB_CACHE, else $HF_HOME/hub)",
    )
    serve.add_argument(
        "--load-format",
        default=None,
        choices=("auto", "dummy"),
        help="auto (default: the folder's *.safetensors) or dummy (random weights from "
        "config.json; the router still needs the folder's tokenizer)",
    )
    serve.add_argument(
        "--dtype", default=None, choices=DTYPES,
        help="weights and activations (auto: fp32 on the CPU; on CUDA the config's 16-bit "
        "dtype, else bfloat16)",
    )
    serve.add_argument(
        "--seed", type=int, default=None,
        help="seeds sampling of requests without a seed, and dummy weights (default 0)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template, or a file holding one, instead of the model's",
    )
    serve.add_argument(
        "--generation-config",
        default=GENERATION_CONFIG_DEFAULT,
        metavar="vllm",
        help="vllm only: a field a request leaves out takes the API's default, not "
        "generation_config.json's (which gives the stop tokens)",
    )
    serve.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; pdserve never runs a model's own code",
    )


def check_serve_flags(args: argparse.Namespace) -> None:
    """ValueError naming the first flag out of range; sets `args.model` from MODEL."""
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        raise ValueError(f"MODEL {args.model_arg!r} and --model {args.model!r} differ; give one")
    args.model = args.model_arg if args.model_arg is not None else args.model
    if args.tensor_parallel_size != 1:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: pdserve runs each node on one "
            "device; scale out with --prefill N and --decode M instead"
        )
    if args.generation_config != GENERATION_CONFIG_DEFAULT:
        raise ValueError(
            f"--generation-config {args.generation_config}: pdserve takes no default sampling "
            "parameters from generation_config.json; a field a request leaves out takes the "
            "API's default (vLLM's --generation-config vllm)"
        )
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
    check_device_flags(args)
