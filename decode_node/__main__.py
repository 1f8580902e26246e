"""`python -m pdserve.decode_node --node-id ID --listen ADDR --router ADDR [--kv-transport shm
...]`.

Decodes prompts computed by prefill nodes, whose KV arrives over `--kv-transport` (shm on one
host, zmq across hosts, cuda_ipc between GPUs of one host) at `--kv-listen`. Serves until
SIGTERM or SIGINT, then exits 0. Logs go to stderr at INFO.
"""

from __future__ import annotations

import sys

from pdserve.decode_node.node import DecodeNode
from pdserve.node.cli import add_kv_flags, node_parser, run_node


def main(argv: list[str] | None = None) -> int:
    parser = node_parser("python -m pdserve.decode_node", __doc__.split("\n\n")[0])
    add_kv_flags(parser, receiver=True)
    return run_node(parser.parse_args(argv), DecodeNode)


if __name__ == "__main__":
    sys.exit(main())
