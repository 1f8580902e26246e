"""Iteration-level (continuous) batching with chunked prefill, priorities, fair shares and
preemption.

Queues: `waiting` (new requests, and preempted ones: recomputed from scratch or swapped out to
host memory) and `running` (holding device blocks). Both are ordered by rank: the sequence's
share of its client request first (engine/sched/request_share.py), then priority aged by arrival
time (engine/sched/sequence_queue.py). Each `schedule()` call builds one step under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`), taking the sequences of both
queues in rank order, as long as budget remains, except that a waiting sequence overtakes a
running one only from a better share tier or priority, never by arrival alone: a prompt being
prefilled in chunks (its KV streaming to a decode node) keeps its turn while earlier arrivals
(a dead node's retried prompts, preempted sequences) wait for theirs.
  - a running sequence takes one token (a decode) or the next chunk of its prompt that fits
    the budget. When blocks run short, the lowest-ranked running sequence is preempted -
    possibly the one being scheduled itself. The preemption policy picks its cure: recompute
    (blocks freed, nothing computed) or swap (its computed blocks copied to host blocks at the
    start of this step, then freed). After such a preemption the step admits nothing more.
  - the first waiting sequence, when it overtakes the next running one: a swapped one gets
    device blocks and its KV copied back in; any other reuses the longest prefix the prefix
    cache holds. It takes a chunk with whatever budget is left, as long as blocks remain
    above a small watermark plus what admitted sequences are still expected to need (the
    admission policy). When it cannot be admitted (no seat, no blocks) but overtakes the
    lowest running one, not yet scheduled in this step, that one is preempted to make room;
    otherwise admission stops for this step. Idle cached blocks are evicted before an admission is refused
    or anything is preempted.
A prompt with n choices (engine/forks.py) counts as n sequences against the cap until it forks
into them (it is refused at submission when n exceeds the cap).
Every sequence submitted fits the whole cache on its own (checked by the engine at submission),
so the first running sequence can always progress: no deadlock.

Fair share, and the bound it gives. A client request's sequences beyond its first `share`
(`max_num_seqs // 4`; a batch of prompts x n choices is one request when submitted under one
`group`) rank behind every request's first share, so they never take a seat, blocks or budget
ahead of another request's first share, and are preempted first to seat one. Hence a request
R of at most `share` sequences waits only for the first shares of the requests that outrank
it (arrived before it at its priority, or more important). Bound: if R arrives while one
other request G runs, however many sequences G has, R's first chunk is scheduled in the first
step after its arrival, provided that
  - G's first share leaves R a seat (2 x share <= max_num_seqs, but a prompt whose choices
    start within the first share counts whole until it forks), blocks, and budget (G's first
    share takes at most `share` tokens in a step once its prompts are computed), and
  - no sequence ranked ahead of R preempts for blocks in that step (each such step evicts
    one of G's sequences ranked behind R, so this delays R by at most as many steps as G
    has sequences beyond its share).
R then samples its first token ceil(prompt / budget left) steps later. The share bounds R's
wait in steps, not a step's length: G's other sequences still run in the budget and seats R
leaves (nothing idles), so where a step's time grows with its batch (the CPU) R's steps are
as long as the whole batch's. Without the share R ranked behind all of G's sequences and
waited for G's whole batch whenever G filled the seats (tests/engine/test_fair_share*.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pdserve.engine.kv.admission import AdmissionPolicy
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.swap_space import SwapSpace
from pdserve.engine.sched.preemption import PreemptionPolicy
from pdserve.engine.sched.request_share import RequestShares
from pdserve.engine.sched.sequence_queue import PriorityOrder, SequenceQueue
from pdserve.engine.sequence import Sequence, SequenceStatus

DEFAULT_PRIORITY_AGING_S = 10.0


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        """How many of this chunk's tokens are prompt tokens (computed, not sampled)."""
        start = self.seq.num_computed_tokens
        return max(0, min(start + self.num_new_tokens, self.seq.num_prompt_tokens) - start)


@dataclass
class SchedulerOutput:
    """One step. Before the forward pass the engine performs, in this order: the swap-outs
    (device, host), the swap-ins (host, device), then frees `host_blocks_to_free`, then the
    copy-on-write copies (src, dst)."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    host_blocks_to_free: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        watermark: float = 0.01,
        preemption: PreemptionPolicy | None = None,
        swap_space: SwapSpace | None = None,
        admission: AdmissionPolicy | None = None,
        priority_aging_s: float = DEFAULT_PRIORITY_AGING_S,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.preemption = preemption or PreemptionPolicy("recompute", bytes_per_token=0)
        self.swap_space = swap_space
        self.admission = admission or AdmissionPolicy("optimistic", block_manager.block_size)
        order = PriorityOrder(priority_aging_s)
        self.waiting = SequenceQueue(order)
        self.running = SequenceQueue(order)
        self.shares = RequestShares(max_num_seqs)
        self._sequence_numbers = itertools.count()
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}

    def add(self, seq: Sequence) -> None:
        seq.sequence_number = next(self._sequence_numbers)
        self.shares.enter(seq)
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """Joins a sequence whose prompt KV is already in its blocks (computed elsewhere)."""
        seq.sequence_number = next(self._sequence_numbers)
        self.shares.enter(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.add(seq)

    @property
    def num_preemptions(self) -> int:
        return sum(self.num_preemptions_by_mode.values())

    @property
    def num_running_seqs(self) -> int:
        """Running sequences, a prompt with n choices counted n times (engine/forks.py)."""
        return sum(seq.num_seqs for seq in self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0  # running[:index] have their chunk in this step
        admitting = True  # until a running sequence preempts, or the first waiting one stays
        while budget > 0:
            if admitting and self._waiting_goes_before(index):
                seq = self.waiting[0]
                num_new = None
                if self.num_running_seqs + seq.num_seqs <= self.max_num_seqs:
                    num_new = self._admit(seq, budget, out)
                if num_new is not None:
                    self.waiting.pop_first()
                    seq.status = SequenceStatus.RUNNING
                    self.running.add(seq)  # at `index`: it ranks between the two
                    out.scheduled.append(ScheduledSequence(seq, num_new))
                    budget -= num_new
                    index += 1
                elif self._overtakes_last_unscheduled(seq, index):
                    self._preempt_for_admission(out)
                else:
                    admitting = False  # no overtaking
            elif index < len(self.running):
                seq = self.running[index]
                num_new = min(seq.num_uncomputed_tokens, budget)
                num_preempted = len(out.preempted)
                if not self._make_room(seq, num_new, out):
                    break
                admitting = admitting and len(out.preempted) == num_preempted
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                index += 1
            else:
                break
        return out

    def _waiting_goes_before(self, index: int) -> bool:
        """Whether the first waiting sequence overtakes running[index] (or none is left)."""
        if not self.waiting:
            return False
        if index == len(self.running):
            return True
        return self._overtakes(self.waiting[0], self.running[index])

    def _overtakes(self, waiting: Sequence, running: Sequence) -> bool:
        """A waiting sequence goes before a running one when it ranks ahead of it and is of a
        better share tier or priority. An admitted sequence then ranks ahead of the running
        sequence it overtook, so running[:index] stay the ones scheduled in this step."""
        rank = self.running.order.rank
        return rank(waiting) < rank(running) and (
            (waiting.share_tier or 0, waiting.priority)
            < (running.share_tier or 0, running.priority)
        )

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Gives a waiting seq its device blocks (and its swapped KV back) and returns the
        tokens it computes in this step; None, changing nothing, if the cache cannot take it
        now."""
        manager = self.block_manager
        headroom_needed = self.watermark_blocks + self.admission.outstanding_blocks(self.running)
        if seq.status is SequenceStatus.SWAPPED:
            block_ids = manager.allocate_blocks(len(seq.host_block_table))
            if block_ids is None:
                return None
            seq.block_table = block_ids
        else:
            num_hit = manager.match_prefix(seq)
        num_new = min(seq.num_uncomputed_tokens, budget)
        blocks_after = max(
            len(seq.block_table), manager.blocks_for_tokens(seq.num_computed_tokens + num_new)
        )
        reserve = headroom_needed + max(0, self.admission.expected_blocks(seq) - blocks_after)
        if not self.running:
            reserve = 0  # alone, any sequence fits (checked at submission)
        if not manager.allocate_slots(seq, num_new, reserve):
            manager.release(seq)
            if seq.status is not SequenceStatus.SWAPPED:
                seq.num_computed_tokens = 0
            return None
        if seq.status is SequenceStatus.SWAPPED:
            out.blocks_to_swap_in.extend(zip(seq.host_block_table, seq.block_table))
            out.host_blocks_to_free.extend(seq.host_block_table)
            seq.host_block_table = []
        else:
            manager.prefix_cache.record_admission(seq.num_tokens, num_hit)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_hit
        return num_new

    def _overtakes_last_unscheduled(self, seq: Sequence, index: int) -> bool:
        """Whether waiting seq may preempt the lowest-ranked running sequence: one with no
        chunk in this step yet (running[index:]) that seq overtakes."""
        return index < len(self.running) and self._overtakes(seq, self.running[-1])

    def _preempt_for_admission(self, out: SchedulerOutput) -> None:
        """Preempts the lowest-ranked running sequence (not yet scheduled in this step) for a
        waiting one that overtakes it."""
        victim = self.running[-1]
        # A block still waiting for its copy-on-write copy would be swapped out unfilled.
        pending_copies = {dst for _, dst in out.blocks_to_copy}
        self._preempt(victim, out, may_swap=pending_copies.isdisjoint(victim.block_table))

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Allocates seq's slots (and private copies of shared blocks), preempting the
        lowest-ranked running sequences as needed; False if seq itself was preempted."""
        while True:
            if self.block_manager.allocate_slots(seq, num_new):
                copies = self.block_manager.copy_on_write(seq, num_new)
                if copies is not None:
                    out.blocks_to_copy.extend(copies)
                    return True
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput, may_swap: bool = True) -> None:
        self.running.remove(seq)
        num_computed = seq.num_computed_tokens
        host_block_ids = None
        if (
            may_swap
            and self.swap_space is not None
            and num_computed
            and self.preemption.prefers_swap(num_computed)
        ):
            num_blocks = self.block_manager.blocks_for_tokens(num_computed)
            host_block_ids = self.swap_space.allocate(num_blocks)
        if host_block_ids is not None:
            out.blocks_to_swap_out.extend(zip(seq.block_table, host_block_ids))
            seq.host_block_table = host_block_ids
            seq.status = SequenceStatus.SWAPPED
            self.num_preemptions_by_mode["swap"] += 1
        else:
            seq.status = SequenceStatus.WAITING
            self.num_preemptions_by_mode["recompute"] += 1
        self.block_manager.free(seq)
        if seq.status is SequenceStatus.WAITING:
            seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self.waiting.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends seq wherever it is and frees its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.waiting.remove(seq)
            self.swap_space.free(seq.host_block_table)
            seq.host_block_table = []
        else:
            return
        self.shares.leave(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.admission.observe_finished(seq, reason)

    def host_block_tables(self) -> list[list[int]]:
        return [seq.host_block_table for seq in self.waiting if seq.host_block_table]
