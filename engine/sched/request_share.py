"""Fair share of the batch between client requests: one request's sequences beyond its share
rank behind every other request's first share.

A client request (`Sequence.group`: the API request a sequence serves, its own request id
unless the caller names one) may bring many sequences: a batch of prompts, each with n
choices. Each sequence gets an ordinal in its request, in submission order (a prompt with n
choices takes n consecutive ordinals, its choices keep theirs after the fork), and its tier is
`ordinal // share`: the request's first `share` sequences are tier 0, the next `share` tier 1,
and so on. The tier comes first in the rank (engine/sched/sequence_queue.py), so the scheduler
serves every request's first share before any request's second share: admission, the token budget
and the choice of preemption victims all follow it. The tier is fixed at submission, like the
rest of the rank; it costs nothing while one request runs alone (ranks only order what
competes), and a request of at most `share` sequences is never behind another request's
sequences beyond that one's share (the bound: engine/sched/scheduler.py).
`share` is `max_num_seqs // SHARES_PER_BATCH` (at least 1): that many requests' first shares
fit the batch together.
"""

from __future__ import annotations

from collections import Counter

from pdserve.engine.sequence import Sequence

SHARES_PER_BATCH = 4


class RequestShares:
    def __init__(self, max_num_seqs: int) -> None:
        self.share = max(1, max_num_seqs // SHARES_PER_BATCH)
        self._num_ordinals: Counter[str] = Counter()  # request -> ordinals handed out
        self._num_unfinished: Counter[str] = Counter()  # request -> sequences in the scheduler

    def enter(self, seq: Sequence) -> None:
        """seq joins the scheduler. A new one (not a choice forked from its prompt, whose
        ordinal came with the prompt's) gets the next `num_seqs` ordinals of its request."""
        group = seq.group
        self._num_unfinished[group] += 1
        if seq.share_tier is not None:
            return
        first = self._num_ordinals[group]
        self._num_ordinals[group] = first + seq.num_seqs
        seq.share_tier = first // self.share
        for index, child in enumerate(seq.children):
            child.share_tier = (first + index) // self.share

    def leave(self, seq: Sequence) -> None:
        """seq has finished; a request with no sequence left starts its ordinals again."""
        group = seq.group
        self._num_unfinished[group] -= 1
        if self._num_unfinished[group] <= 0:
            del self._num_unfinished[group]
            self._num_ordinals.pop(group, None)
