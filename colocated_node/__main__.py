"""`python -m pdserve.colocated_node --node-id ID --listen ADDR --router ADDR [engine flags]`.

One engine that prefills and decodes the requests the router sends it. Serves until SIGTERM or
SIGINT, then exits 0. Logs go to stderr at INFO.
"""

from __future__ import annotations

import sys

from pdserve.colocated_node.node import ColocatedNode
from pdserve.node.cli import node_parser, run_node


def main(argv: list[str] | None = None) -> int:
    parser = node_parser("python -m pdserve.colocated_node", __doc__.split("\n\n")[0])
    return run_node(parser.parse_args(argv), ColocatedNode)


if __name__ == "__main__":
    sys.exit(main())
