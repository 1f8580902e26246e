"""Iteration-level (continuous) batching with chunked prefill and preemption by recompute.

Queues: `waiting` (FCFS; preempted sequences re-enter at the front) and `running` (in admission
order; holds blocks). Each `schedule()` call builds one step under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):
  1. running sequences first, in admission order: a decode takes one token, an unfinished
     prefill takes the next chunk that fits the budget. When blocks run short, the most recently
     admitted running sequence is preempted (blocks freed, back to the front of `waiting`,
     recomputed from scratch later) - possibly the one being scheduled itself;
  2. then waiting sequences, in order, reuse the longest prefix the prefix cache holds and take
     chunks of the rest of their prompts with whatever budget is left, as long as blocks remain
     above a small watermark (so decodes are not starved). Idle cached blocks are evicted before
     an admission is refused or anything is preempted.
Every sequence submitted fits the whole cache on its own (checked by the engine at submission),
so the oldest running sequence can always progress: no deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

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
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_new, out):
                break
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_hit = self.block_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new, self.watermark_blocks):
                self.block_manager.release(seq)
                seq.num_computed_tokens = 0
                break
            self.block_manager.prefix_cache.record_admission(seq.num_tokens, num_hit)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_hit
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return out

    def add_running(self, seq: Sequence) -> None:
        """Joins a sequence whose prompt KV is already in its blocks (computed elsewhere)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Allocates seq's slots (and private copies of shared blocks), preempting the most
        recently admitted running sequences as needed; False if seq itself was preempted."""
        while True:
            if self.block_manager.allocate_slots(seq, num_new):
                copies = self.block_manager.copy_on_write(seq, num_new)
                if copies is not None:
                    out.blocks_to_copy.extend(copies)
                    return True
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends seq wherever it is and frees its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
