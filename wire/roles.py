"""The roles a node plays, spelled once. A role's value is its name on the wire (NodeStats),
in node ids (`prefill-0.8000`), in option metadata (`roles=`) and on the command line
(`pdserve serve`, `pdserve prefill|decode|colocated` and `python -m pdserve.node ROLE`); a `Role` compares equal to it.

  COLOCATED  computes a request's prompt and decodes it, alone
  PREFILL    computes prompts and ships their KV to a decode node
  DECODE     reserves KV blocks, has a prefill node fill them, and decodes
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def node_class(self) -> str:
        """`module:Class` of this role's node, which `python -m pdserve.node ROLE` imports."""
        if self is Role.COLOCATED:
            return "pdserve.node.colocated:ColocatedNode"
        return f"pdserve.{self.value}_node.node:{self.value.capitalize()}Node"


KV_ROLES = (Role.PREFILL, Role.DECODE)  # the roles whose nodes move KV
