"""CLI of the colocated node: `python -m decode_node --node-id ID --listen ADDR --router ADDR`.

Loads the model (`--model` omitted means the default model), binds a PULL socket at --listen
for Generate/Abort, connects a PUSH socket to --router for TokenBatch/RequestFailed/NodeStats,
and serves until SIGTERM or SIGINT, then exits 0. Logs go to stderr at INFO.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from engine.config import EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m decode_node", description=__doc__)
    parser.add_argument("--model", default=None, help="model folder (default: default model)")
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--listen", required=True, help="zmq address to bind, e.g. tcp://...")
    parser.add_argument("--router", required=True, help="zmq address of the router's PULL")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--attention-backend", default=None, help="torch (CPU) or triton (GPU)")
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--prefix-cache-min-blocks", type=int, default=None)
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, metavar="SECONDS")
    args = parser.parse_args(argv)
    if args.heartbeat_interval <= 0:
        parser.error("--heartbeat-interval must be positive")
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = {
        name: getattr(args, name)
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_memory",
            "num_kv_blocks",
            "block_size",
            "prefix_cache_min_blocks",
            "attention_backend",
        )
        if getattr(args, name) is not None
    }
    return EngineConfig(
        model=args.model, enable_prefix_caching=args.enable_prefix_caching, **options
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logger = logging.getLogger("decode_node")
    signals: list[int] = []
    node = None

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        if node is not None:
            node.stop()

    # Installed before the (slow) model load so an early SIGTERM still exits cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from decode_node.colocated import ColocatedNode

    try:
        config = engine_config(args)
    except ValueError as error:
        logger.error("invalid settings: %s", error)
        return 2
    logger.info("loading model %s", config.model or "(default)")
    node = ColocatedNode(
        config,
        node_id=args.node_id,
        listen_address=args.listen,
        router_address=args.router,
        heartbeat_interval=args.heartbeat_interval,
    )
    if not signals:
        node.run()
    logger.info("exiting on %s", signal.Signals(signals[0]).name if signals else "stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
