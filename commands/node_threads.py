"""How many torch threads each node of a `pdserve serve` deployment gets on a CPU host.

The default layout, chosen from bench/results/thread_layout.md (2-core Intel Xeon, 1P1D, the
default model; docs/performance.md#threads-per-node):

* Every node gets a disjoint, equal share of the usable cores (cores // nodes, at least 1).
  Giving every node all the cores instead lets two busy processes' thread teams outnumber the
  cores, and each parallel region then waits at its barrier for a thread the other process
  holds: 2+2 threads against 1+1 made TTFT P50 3.8x worse at concurrency 64 and 10x in a
  long-prompt mix, and P99 ITL 1.4x and 9.9x.
* A deployment's only decode node also borrows the prefill nodes' shares - every core - while
  none of its prompts is being prefilled (decode_node/borrowed_threads.py). With short prompts
  the prefill node idles nearly all the time, and a disjoint share strands its core: the
  decode node computed on one core, 23.7 tokens/s at concurrency 1 and 511 at 64, against
  32.0 and 675 borrowing (colocated on both cores: 33.4 and 694). The prefill nodes compute
  only that decode node's prompts, so borrowing never oversubscribes the cores. With several
  decode nodes, or a router that nodes of other hosts can join, no decode node can tell whom
  a prefill node works for, and nothing is borrowed.
* `--threads-per-node N` is the operator's layout: N threads for every node, nothing borrowed.
* On a GPU host the launcher sets no thread count unless asked (the node's own default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.wire.roles import Role


@dataclass(frozen=True)
class NodeThreads:
    """One node's torch threads: its own (None: torch's default) and, for a decode node that
    borrows, the count while none of its prompts is being prefilled."""

    num_threads: int | None
    threads_while_prefill_idle: int | None = None


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one); the same as
    engine/cpu/cpu_features.py's, which the launcher does not import (it loads no engine code)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def plan_node_threads(
    roles: list[str],
    cores: int,
    on_gpus: bool,
    requested: int | None = None,
    others_may_join: bool = False,
) -> list[NodeThreads]:
    """Threads for each node, in the order of `roles`, on a
    host with `cores` usable cores (see the module docstring for the rule). `others_may_join`:
    the router listens where nodes of other hosts can register, and a decode node joining
    that way could keep this host's prefill nodes busy unseen: nothing is borrowed."""
    if requested is not None or on_gpus:
        return [NodeThreads(requested) for _ in roles]
    share = max(1, cores // len(roles))
    lone_decode = roles.count(Role.DECODE) == 1 and Role.PREFILL in roles and not others_may_join
    borrow = lone_decode and share < cores
    return [
        NodeThreads(share, cores if borrow and role == Role.DECODE else None) for role in roles
    ]
