"""`python -m prefill_node --node-id ID --listen ADDR --router ADDR [--kv-transport shm]`.

Computes prompts for decode nodes (which send PrefillRequests naming their reserved blocks),
writes their KV over `--kv-transport`, and sends each first token to the router. Serves until
SIGTERM or SIGINT, then exits 0. Logs go to stderr at INFO.
"""

from __future__ import annotations

import sys

from engine.node_cli import node_parser, run_node


def main(argv: list[str] | None = None) -> int:
    parser = node_parser("python -m prefill_node", __doc__.split("\n\n")[0])
    parser.add_argument("--kv-transport", default="shm", choices=("shm", "zmq", "cuda_ipc"))
    args = parser.parse_args(argv)

    def build(config, cluster_auth):
        from engine.llm_engine import LLMEngine
        from prefill_node.node import PrefillNode

        return PrefillNode(
            LLMEngine(config),
            args.node_id,
            args.listen,
            args.router,
            args.kv_transport,
            args.heartbeat_interval,
            args.advertise,
            cluster_auth,
        )

    return run_node(args, build)


if __name__ == "__main__":
    sys.exit(main())
