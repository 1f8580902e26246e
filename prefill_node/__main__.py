"""`python -m pdserve.prefill_node --node-id ID --listen ADDR --router ADDR [--kv-transport shm]`.

Computes prompts for decode nodes (which send PrefillRequests naming their reserved blocks),
writes their KV over `--kv-transport`, and sends each first token to the router. Serves until
SIGTERM or SIGINT, then exits 0. Logs go to stderr at INFO.
"""

from __future__ import annotations

import sys

from pdserve.node.cli import add_kv_flags, node_parser, run_node
from pdserve.prefill_node.node import PrefillNode


def main(argv: list[str] | None = None) -> int:
    parser = node_parser("python -m pdserve.prefill_node", __doc__.split("\n\n")[0])
    add_kv_flags(parser, receiver=False)
    return run_node(parser.parse_args(argv), PrefillNode)


if __name__ == "__main__":
    sys.exit(main())
