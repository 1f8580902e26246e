"""`python -m decode_node --node-id ID --listen ADDR --router ADDR [--role decode ...]`.

`--role colocated` (the default) prefills and decodes in one engine; `--role decode` takes
prompts computed by prefill nodes, whose KV arrives over `--kv-transport` (shm on one host,
zmq across hosts, cuda_ipc between GPUs of one host) at `--kv-listen`. Serves until SIGTERM or
SIGINT, then exits 0. Logs go to stderr at INFO.
"""

from __future__ import annotations

import sys

from engine.node_cli import node_parser, run_node


def main(argv: list[str] | None = None) -> int:
    parser = node_parser("python -m decode_node", __doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("colocated", "decode"), default="colocated")
    parser.add_argument("--kv-transport", default="shm", choices=("shm", "zmq", "cuda_ipc"))
    parser.add_argument("--kv-listen", default="tcp://127.0.0.1:0", help="KV channel bind")
    parser.add_argument(
        "--transfer-timeout", type=float, default=30.0, metavar="SECONDS",
        help="a KV transfer's deadline from its first write; the first token's after the KV "
        "arrived (default 30)",
    )
    parser.add_argument(
        "--queue-timeout", type=float, default=120.0, metavar="SECONDS",
        help="the wait for free KV blocks, then for the prefill node to start (default 120)",
    )
    args = parser.parse_args(argv)

    def build(config, cluster_auth):
        if args.role == "colocated":
            from decode_node.colocated import ColocatedNode

            return ColocatedNode(
                config,
                args.node_id,
                args.listen,
                args.router,
                args.heartbeat_interval,
                args.advertise,
                cluster_auth,
            )
        from decode_node.decode import DecodeNode

        return DecodeNode(
            config,
            args.node_id,
            args.listen,
            args.router,
            args.kv_transport,
            args.kv_listen,
            args.transfer_timeout,
            args.heartbeat_interval,
            args.advertise,
            cluster_auth,
            queue_timeout_s=args.queue_timeout,
        )

    return run_node(args, build)


if __name__ == "__main__":
    sys.exit(main())
