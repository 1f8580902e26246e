"""What every node's command line shares: engine flags, node addresses, signals, logging.

`python -m colocated_node`, `python -m prefill_node` and `python -m decode_node` build their
parser with `node_parser` (plus `add_kv_flags` for the roles that move KV), then call
`run_node(args, role)`: logging to stderr at INFO, SIGTERM and SIGINT handlers installed before
the (slow) model load, then `role(engine_config=..., config=...)` makes the node and `run()`
serves until a signal; the exit status is 0, or 2 for invalid settings. The cluster secret (`--cluster-secret`, else `PDSERVE_CLUSTER_SECRET`) is read here,
once; without one every address the node binds, advertises or dials must be a loopback one.

Device: a node runs on `--device` (default: the first GPU it sees, else the CPU), made the
process's current CUDA device before the model loads. `pdserve serve` lists the node's own GPU
first in its CUDA_VISIBLE_DEVICES (pdserve/launcher.py), so the default is the right one.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch

from engine.config import LOAD_FORMATS, EngineConfig
from kvtransfer import TRANSPORT_NAMES
from node.config import NodeConfig
from wire.cluster_auth import SECRET_ENV, ClusterAuth

_ENGINE_OPTIONS = (
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "num_kv_blocks",
    "block_size",
    "prefix_cache_min_blocks",
    "attention_backend",
    "load_format",
    "dtype",
    "seed",
    "device",
    "gpu_memory_utilization",
    "processes_on_device",
    "num_threads",
    "preemption_mode",
    "admission",
    "admission_quantile",
    "priority_aging_s",
)


def node_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", default=None, help="model folder (default: default model)")
    parser.add_argument(
        "--load-format", default=None, choices=LOAD_FORMATS,
        help="auto (default: the folder's *.safetensors) or dummy (random weights from "
        "config.json alone, for measuring a model's shapes without its weights)",
    )
    parser.add_argument(
        "--dtype", default=None,
        help="auto (default: fp32 on the CPU; the config's 16-bit dtype, else bf16, on CUDA), "
        "bfloat16, float16 or float32",
    )
    parser.add_argument(
        "--seed", type=int, default=None,
        help="seeds the sampler of requests without a seed, and dummy weights (default 0)",
    )
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--listen", required=True, help="zmq address to bind, e.g. tcp://...")
    parser.add_argument("--advertise", default=None, help="address others reach --listen at")
    parser.add_argument("--router", required=True, help="zmq address of the router's PULL")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument(
        "--attention-backend", default=None,
        help="auto (default: triton on CUDA, torch on the CPU), torch or triton",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true",
        help="run every step eagerly: no CUDA graphs (default: decode steps replay CUDA "
        "graphs on CUDA with the triton backend)",
    )
    parser.add_argument(
        "--device", default=None,
        help="auto (default: the first visible GPU, else the CPU), cpu or cuda:N",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
        help="fraction of the GPU's memory the node processes on it hold together (default "
        "0.9), in equal shares",
    )
    parser.add_argument(
        "--processes-on-device", type=int, default=None, metavar="N",
        help="node processes sharing this node's GPU (default 1); `pdserve serve` counts them",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--prefix-cache-min-blocks", type=int, default=None)
    parser.add_argument(
        "--preemption-mode", default=None, help="auto (cheaper by cost), recompute or swap"
    )
    parser.add_argument(
        "--swap-space", type=float, default=None, metavar="GIB",
        help="host memory for swapped-out KV, in GiB (default 4; 0 disables swapping)",
    )
    parser.add_argument(
        "--admission", default=None, help="optimistic (default), worst-case or predicted"
    )
    parser.add_argument(
        "--admission-quantile", type=float, default=None,
        help="quantile of observed output lengths that predicted admission reserves",
    )
    parser.add_argument(
        "--priority-aging-seconds", dest="priority_aging_s", type=float, default=None,
        help="seconds of waiting worth one priority level (0: strict priorities)",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, metavar="SECONDS")
    parser.add_argument(
        "--cluster-secret", default=os.environ.get(SECRET_ENV) or None, metavar="SECRET",
        help=f"shared by the router and every node (default: ${SECRET_ENV}); needed for "
        "any address that is not a loopback one",
    )
    return parser


def add_kv_flags(parser: argparse.ArgumentParser, *, receiver: bool) -> None:
    """The KV transfer flags: the transport (both ends), and the receiving end's channel
    address and deadlines (decode nodes)."""
    defaults = NodeConfig(node_id="-", listen_address="-", router_address="-")
    parser.add_argument("--kv-transport", default=defaults.kv_transport, choices=TRANSPORT_NAMES)
    if not receiver:
        return
    parser.add_argument(
        "--kv-listen", default=defaults.kv_listen_address, help="KV channel bind address"
    )
    parser.add_argument(
        "--transfer-timeout", type=float, default=defaults.transfer_timeout_s, metavar="SECONDS",
        help="a KV transfer's deadline from its first write; the first token's after the KV "
        f"arrived (default {defaults.transfer_timeout_s:g})",
    )
    parser.add_argument(
        "--queue-timeout", type=float, default=defaults.queue_timeout_s, metavar="SECONDS",
        help="the wait for free KV blocks, then for the prefill node to start (default "
        f"{defaults.queue_timeout_s:g})",
    )


def node_config(args: argparse.Namespace, auth: ClusterAuth) -> NodeConfig:
    """ValueError for settings out of range."""
    defaults = NodeConfig(node_id="-", listen_address="-", router_address="-")
    return NodeConfig(
        node_id=args.node_id,
        listen_address=args.listen,
        router_address=args.router,
        advertise_address=args.advertise,
        heartbeat_interval=args.heartbeat_interval,
        cluster_auth=auth,
        kv_transport=getattr(args, "kv_transport", defaults.kv_transport),
        kv_listen_address=getattr(args, "kv_listen", defaults.kv_listen_address),
        transfer_timeout_s=getattr(args, "transfer_timeout", defaults.transfer_timeout_s),
        queue_timeout_s=getattr(args, "queue_timeout", defaults.queue_timeout_s),
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = {
        name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name) is not None
    }
    if args.swap_space is not None:
        options["swap_space"] = int(args.swap_space * (1 << 30))
    if args.enforce_eager:
        options["cuda_graphs"] = False
    return EngineConfig(
        model=args.model, enable_prefix_caching=args.enable_prefix_caching, **options
    )


def cluster_auth(args: argparse.Namespace) -> ClusterAuth:
    """ValueError for a bad secret, or for a non-loopback address without a secret."""
    auth = ClusterAuth.from_secret(args.cluster_secret)
    auth.check_addresses(
        [
            ("--listen", args.listen),
            ("--advertise", args.advertise),
            ("--router", args.router),
            ("--kv-listen", getattr(args, "kv_listen", None)),
        ]
    )
    return auth


def use_device(device: torch.device) -> None:
    """Makes a node's CUDA device the process's current one, so kernels, streams and events
    that take the current device (Triton launches, CUDA graphs) land on it."""
    if device.type != "cuda" or device.index is None:
        return
    if not 0 <= device.index < torch.cuda.device_count():
        raise ValueError(
            f"device {device} is not visible: this process sees "
            f"{torch.cuda.device_count()} CUDA device(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    torch.cuda.set_device(device)


def run_node(args: argparse.Namespace, role: Callable[..., Any]) -> int:
    """Runs the node `role(engine_config=..., config=...)` builds until a signal."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logger = logging.getLogger("node")
    signals: list[int] = []
    node = None

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        if node is not None:
            node.stop()

    # Installed before the (slow) model load so an early SIGTERM still exits cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        auth = cluster_auth(args)
        config = node_config(args, auth)
        engine = engine_config(args)
        use_device(engine.resolve_device())
    except ValueError as error:
        logger.error("invalid settings: %s", error)
        return 2
    logger.info("loading model %s", engine.model or "(default)")
    node = role(engine_config=engine, config=config)
    if not signals:
        node.run()
    logger.info("exiting on %s", signal.Signals(signals[0]).name if signals else "stop")
    return 0
