"""Cores a decode node borrows from its host's prefill nodes while they have nothing to do.

On a CPU host `pdserve serve` gives each node a disjoint share of the cores
(commands/node_threads.py): two processes whose thread teams together outnumber the cores stall
each other at every parallel region's barrier, so a prefill burst must not land on the decode
node's cores. But with short prompts the prefill nodes idle most of the time, and their share
would idle with them. So the launcher tells a deployment's only decode node
`threads_while_prefill_idle` (every core): before each step the node runs that many torch
threads while none of its prompts is being prefilled (no request in TRANSFERRING, the stage
between its PrefillRequest and the last KV block's arrival), and its own share while one is.
The only prompts a host's prefill nodes compute are this node's, so the two never
oversubscribe the cores. A switch is one `torch.set_num_threads` (well under a microsecond),
made only when the answer changes; the compiled decode attention kernel follows torch's count.
"""

from __future__ import annotations

import torch


class BorrowedThreads:
    """`own`: the node's share (None: torch's count when built); `while_prefill_idle`: the
    count while nothing is being prefilled for it (None: `own` throughout, nothing borrowed)."""

    def __init__(self, own: int | None, while_prefill_idle: int | None) -> None:
        self.own = own if own is not None else torch.get_num_threads()
        self.while_prefill_idle = while_prefill_idle
        self.current = torch.get_num_threads()
        self.switches = 0

    def update(self, prefilling: bool) -> None:
        """Called before each engine step with whether any of the node's prompts is being
        prefilled now."""
        if self.while_prefill_idle is None:
            return
        wanted = self.own if prefilling else self.while_prefill_idle
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
            self.switches += 1
