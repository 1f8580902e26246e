"""`python -m pdserve.node ROLE --node-id ID --listen ADDR --router ADDR [flags]`: one node.

The one entry point of every node process, whatever its role (`pdserve serve` starts each node
this way; `pdserve ROLE [flags]` is the same command):
  colocated  prefills and decodes the requests the router sends it (node/colocated.py)
  prefill    computes prompts for decode nodes and writes their KV over `--kv-transport`
             (prefill_node/node.py)
  decode     decodes prompts computed by prefill nodes, whose KV arrives over
             `--kv-transport` at `--kv-listen` (decode_node/node.py)
The role names the node class (wire/roles.py); the flags, settings and signals every node
shares are node/cli.py's. Serves until SIGTERM or SIGINT, then exits 0; 2 for invalid
settings. Logs go to stderr.
"""

from __future__ import annotations

import importlib
import sys

from pdserve.node.cli import role_parser, run_node
from pdserve.wire.roles import Role

ROLES = ", ".join(Role)


def node_class(role: Role) -> type:
    module, name = role.node_class.split(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in list(Role):
        print(f"usage: python -m pdserve.node ROLE [flags]; ROLE is one of {ROLES}",
              file=sys.stderr)
        return 2
    role = Role(argv[0])
    cls = node_class(role)
    description = sys.modules[cls.__module__].__doc__.split("\n\n")[0]  # what the role does
    parser = role_parser(role, description)
    return run_node(parser.parse_args(argv[1:]), cls)


if __name__ == "__main__":
    sys.exit(main())
