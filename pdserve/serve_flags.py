"""The flags of `pdserve serve` (and the engine flags `pdserve generate` and `pdserve chat` share).

The engine's, the nodes' and the logging options are generated from EngineConfig, NodeConfig and
LogSettings (wire/config_flags.py); what is written here are the launcher's own flags.

Where a flag means what vLLM's flag of the same name means, it has vLLM's spelling (the table in
docs/operations.md maps each to vLLM's and SGLang's). `check_serve_flags` checks them once,
before the launcher resolves the model or starts any process; a ValueError from it is printed
with `pdserve serve`'s usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from wire.config_flags import add_flags
from wire.log_format import LogSettings

GENERATION_CONFIG_DEFAULT = "vllm"


def _not_launcher_set(f: dataclasses.Field) -> bool:
    return not f.metadata.get("launcher_sets")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """`pdserve generate` and `pdserve chat`: every EngineConfig option, and sampling."""
    from engine.config import EngineConfig

    add_flags(parser, EngineConfig)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)


def _node_option_flags(serve: argparse.ArgumentParser) -> None:
    """Every EngineConfig and NodeConfig option the launcher does not decide itself, generated
    from the dataclasses; the launcher hands each node the values given (pdserve/launcher.py)."""
    from engine.config import EngineConfig
    from node.config import NodeConfig

    add_flags(
        serve.add_argument_group("engine (each node's EngineConfig)"), EngineConfig,
        select=_not_launcher_set,
    )
    add_flags(
        serve.add_argument_group("node (each node's NodeConfig)"), NodeConfig,
        select=_not_launcher_set,
    )
    add_flags(serve.add_argument_group("logging (the router's and every node's)"), LogSettings)


def _failure_args(parser: argparse.ArgumentParser) -> None:
    """Deadlines of failure handling (docs/failure-handling.md)."""
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a node is dead after this long without a heartbeat (default: 2 intervals)",
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
    _node_option_flags(serve)
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
    if args.drain_timeout < 0:
        raise ValueError("--drain-timeout must be 0 or more")
